"""Evaluation measures: sliding-window perplexity, passkey retrieval, decode speed and cache memory."""

from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@torch.no_grad()
def sliding_nll(model, token_ids: torch.Tensor, window: int, stride: int) -> tuple[float, int]:
    """Summed next-token NLL and the number of scored tokens of one document, with a sliding window.

    Windows of `window` tokens start every `stride` tokens; each scores only the tokens the previous window
    did not, with the rest of the window as context (the usual Transformers recipe), so a long document is
    covered whole rather than truncated. With `stride < window` every token after the first is scored.
    """
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    device = next(model.parameters()).device
    length = int(token_ids.numel())
    total, count, previous_end = 0.0, 0, 0
    for begin in range(0, length - 1, stride):
        end = min(begin + window, length)
        ids = token_ids[begin:end].to(device)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # predicts positions begin+1..end-1
        first = max(previous_end - begin - 1, 0)  # skip what an earlier window scored
        nll = F.cross_entropy(logits[first:], ids[0, 1 + first :], reduction="sum")
        total, count = total + nll.item(), count + (end - begin - 1 - first)
        previous_end = end
        if end == length:
            break
    return total, count


def perplexity_of_texts(model, tokenizer, texts: list[str], window: int, stride: int, max_tokens: int | None = None,
                        progress: bool = True) -> dict:
    """Corpus perplexity over `texts` (each tokenised whole, scored with `sliding_nll`), optionally capped."""
    total, count = 0.0, 0
    for text in tqdm(texts, desc="perplexity", disable=not progress, leave=False):
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        if max_tokens is not None:
            ids = ids[: max(0, max_tokens - count) + 1]
        if ids.numel() < 2:
            continue
        nll, n = sliding_nll(model, ids, window, stride)
        total, count = total + nll, count + n
        if max_tokens is not None and count >= max_tokens:
            break
    if count == 0:
        raise ValueError("no text to score (every document is shorter than two tokens)")
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


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


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: KV tensors of softmax layers, conv and recurrent states of delta layers."""
    total = 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for attribute in ("conv_states", "recurrent_states"):
            tensors += list(getattr(layer, attribute, {}).values())
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


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
