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
    """Token ids of exactly `length` tokens: filler, the passkey sentence (the needle), more filler, the question.

    Placement is exact on the token ids: with `F = length - len(needle) - len(question)` filler tokens, the
    needle's first token is at index `round(depth * F)` (depth 0: first thing in the prompt; 1: right before the
    question). The filler is its sentences tokenised once and repeated, cut at a token.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth {depth} is outside 0..1; give --passkey_depths such as 0.1,0.5,0.9")
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question = " What is the pass key? The pass key is"
    filler_ids = tokenizer(PASSKEY_FILLER, add_special_tokens=False)["input_ids"]
    needle_ids = tokenizer(needle, add_special_tokens=False)["input_ids"]
    question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
    budget = length - len(needle_ids) - len(question_ids)
    if budget < 0:
        raise ValueError(f"a passkey prompt of {length} tokens cannot hold the needle and the question "
                         f"({len(needle_ids) + len(question_ids)} tokens); give longer --passkey_lengths")
    filler = (filler_ids * (budget // max(1, len(filler_ids)) + 1))[:budget]
    cut = round(depth * budget)
    return torch.tensor(filler[:cut] + needle_ids + filler[cut:] + question_ids, dtype=torch.long)


#: tokens per forward when a long prompt is read into the cache before generating or timing
PREFILL_PIECE = 4096


@torch.no_grad()
def prefill(model, ids: torch.Tensor, piece: int = PREFILL_PIECE):
    """Read `ids` [1, n] into a fresh cache in forward calls of at most `piece` tokens; the last call's output.

    Memory stays that of a `piece`-token forward (a sliding-window layer's mask is [piece, window + piece], not
    [n, n]); only the last position's logits are computed."""
    out, cache = None, None
    for start in range(0, ids.shape[1], piece):
        out = model(input_ids=ids[:, start : start + piece], cache=cache, use_cache=True, logits_to_keep=1)
        cache = out.cache
    return out


@torch.no_grad()
def greedy_continuation(model, ids: torch.Tensor, new_tokens: int, pad_token_id: int,
                        prefill_piece: int = PREFILL_PIECE) -> torch.Tensor:
    """`generate`'s greedy continuation of `ids` [1, n] (the new ids only); a prompt longer than `prefill_piece`
    is first read into the cache in pieces (all but its last token), so a 64k-token prompt fits in memory."""
    cache = prefill(model, ids[:, :-1], prefill_piece).cache if ids.shape[1] > prefill_piece else None
    extra = {} if cache is None else {"cache": cache}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=pad_token_id, **extra)
    return out[0, ids.shape[1]:]


@torch.no_grad()
def passkey_grid(model, tokenizer, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0,
                 progress: bool = True) -> dict[int, dict[float, float]]:
    """Share of prompts whose greedy continuation contains the passkey, per prompt length and needle depth (a long
    prompt prefilled in pieces: `greedy_continuation`). A length's passkeys depend on `seed` and the length only, not
    on the other lengths asked for, so a length measured alone gets the prompts it gets among others."""
    device = next(model.parameters()).device
    results = {}
    for length in lengths:
        rng = random.Random(f"passkey {seed} {length}")
        results[length] = {}
        for depth in tqdm(depths, desc=f"passkey {length}", disable=not progress, leave=False):
            hits = 0
            for _ in range(trials):
                passkey = rng.randint(10000, 99999)
                ids = passkey_prompt(tokenizer, length, depth, passkey).to(device)[None]
                answer_ids = greedy_continuation(model, ids, 8, tokenizer.pad_token_id or tokenizer.eos_token_id)
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
                hits += str(passkey) in answer
            results[length][depth] = hits / trials
    return results


def mean_over_depths(grid: dict[int, dict[float, float]]) -> dict[int, float]:
    """Passkey accuracy per length from `passkey_grid` (every depth has the same number of trials)."""
    return {length: sum(row.values()) / len(row) for length, row in grid.items()}


def passkey_accuracy(model, tokenizer, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0,
                     progress: bool = True) -> dict[int, float]:
    """Share of prompts whose greedy continuation contains the passkey, per prompt length (over all depths)."""
    return mean_over_depths(passkey_grid(model, tokenizer, lengths, depths, trials, seed, progress))


@torch.no_grad()
def decode_speed(model, context: int, new_tokens: int = 16, prefill_piece: int = PREFILL_PIECE,
                 seed: int = 0) -> dict:
    """Milliseconds per generated token after a `context`-token prompt, and the cache bytes held then.

    The prompt is random token ids, prefilled in pieces of `prefill_piece` tokens (not timed).
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=generator).to(device)
    out = prefill(model, prompt, prefill_piece)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    elapsed = time.perf_counter() - started
    return {"context": context, "ms_per_token": 1000 * elapsed / new_tokens, "cache_bytes": cache_bytes(cache)}
