"""Fixed-length token windows cut from documents, and perplexity over them.

Windows are spread over the documents evenly (window `k` of `n` comes from document `floor(k * D / n)`), so a
small budget still samples every era / author of a corpus rather than only the first file. The same
arguments always give the same windows.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def token_windows(tokenizer, texts: list[str], seq_len: int, num_windows: int) -> torch.Tensor:
    """`num_windows` windows of `seq_len` token ids, as a `[num_windows, seq_len]` LongTensor.

    Each document is tokenized without special tokens and cut into consecutive windows from its start; a
    document too short for its share passes the rest on to the next one.
    """
    if seq_len < 2 or num_windows < 1:
        raise ValueError(f"need seq_len >= 2 and num_windows >= 1, got {seq_len}, {num_windows}")
    if not texts:
        raise ValueError("no texts to cut windows from")
    docs = len(texts)
    share = [0] * docs
    for k in range(num_windows):
        share[(k * docs) // num_windows] += 1
    windows: list[torch.Tensor] = []
    owed = 0
    for index in range(docs):
        wanted = share[index] + owed
        if wanted == 0:
            continue
        # tokenize only the prefix this document can contribute (about 8 characters per token is generous)
        text = texts[index][: wanted * seq_len * 8 + 1000]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        available = len(ids) // seq_len
        take = min(wanted, available)
        windows.extend(torch.tensor(ids[i * seq_len : (i + 1) * seq_len]) for i in range(take))
        owed = wanted - take
    if len(windows) < num_windows:
        raise ValueError(f"the texts hold only {len(windows)} windows of {seq_len} tokens, {num_windows} wanted")
    return torch.stack(windows[:num_windows]).long()


def random_windows(vocab_size: int, seq_len: int, num_windows: int, seed: int = 0) -> torch.Tensor:
    """Random token ids: a stand-in for calibration text when a source has no tokenizer (tiny test models)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_windows, seq_len), generator=generator)


def autocast(enabled: bool):
    """bf16 autocast on CPU (about twice as fast on AMX/AVX-512 machines), or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


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


__all__ = ["autocast", "mean_nll", "perplexity", "random_windows", "token_windows"]
