"""Perplexity: over fixed token windows (`mean_nll`, `perplexity`) and over whole documents with a sliding
window (`sliding_nll`, `perplexity_of_texts`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..precision import autocast


@torch.no_grad()
def mean_nll(model, windows: torch.Tensor, batch_size: int = 2, bf16: bool = False, desc: str | None = None) -> float:
    """Mean next-token negative log-likelihood (nats) of `model` over every window (no cache, no padding)."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    batches = range(0, len(windows), batch_size)
    for start in tqdm(batches, desc=desc, disable=desc is None, leave=False):
        ids = windows[start : start + batch_size].to(device)
        with autocast(bf16):
            logits = model(input_ids=ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    return total / count


def perplexity(model, windows: torch.Tensor, batch_size: int = 2, bf16: bool = False, desc: str | None = None) -> float:
    """exp(mean next-token NLL) of `model` on `windows`."""
    return math.exp(mean_nll(model, windows, batch_size=batch_size, bf16=bf16, desc=desc))


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


__all__ = ["mean_nll", "perplexity", "perplexity_of_texts", "sliding_nll"]
