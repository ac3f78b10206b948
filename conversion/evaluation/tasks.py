"""Evaluation tasks beyond perplexity: passkey retrieval, and decode speed with the cache memory it holds."""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..memory import cache_bytes

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(tokenizer, length: int, depth: float, passkey: int) -> torch.Tensor:
    """Token ids of about `length` tokens: filler with the passkey sentence at relative `depth`, then the question."""
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = " What is the pass key? The pass key is"
    filler_ids = tokenizer(PASSKEY_FILLER, add_special_tokens=False)["input_ids"]
    needle_ids = tokenizer(needle, add_special_tokens=False)["input_ids"]
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    budget = max(0, length - len(needle_ids) - len(question_ids))
    filler = (filler_ids * (budget // max(1, len(filler_ids)) + 1))[:budget]
    cut = int(round(depth * len(filler)))
    return torch.tensor(filler[:cut] + needle_ids + filler[cut:] + question_ids, dtype=torch.long)


@torch.no_grad()
def passkey_accuracy(model, tokenizer, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0,
                     progress: bool = True) -> dict[int, float]:
    """Share of prompts whose greedy continuation contains the passkey, per prompt length."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    results = {}
    for length in lengths:
        hits, total = 0, 0
        for depth in tqdm(depths, desc=f"passkey {length}", disable=not progress, leave=False):
            for _ in range(trials):
                passkey = rng.randint(10000, 99999)
                ids = passkey_prompt(tokenizer, length, depth, passkey).to(device)[None]
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                hits += str(passkey) in answer
                total += 1
        results[length] = hits / total
    return results


@torch.no_grad()
def decode_speed(model, context: int, new_tokens: int = 16, prefill_piece: int = 4096, seed: int = 0) -> dict:
    """Milliseconds per generated token after a `context`-token prompt, and the cache bytes held then.

    The prompt is random token ids, prefilled in pieces of `prefill_piece` tokens (not timed).
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(device)
    cache = None
    for start in range(0, context, prefill_piece):
        out = model(input_ids=prompt[:, start : start + prefill_piece], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    token = out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    elapsed = time.perf_counter() - started
    return {"context": context, "ms_per_token": 1000 * elapsed / new_tokens, "cache_bytes": cache_bytes(cache)}
