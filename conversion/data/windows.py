"""Fixed-length token windows cut from documents (and random ones for models without a tokenizer).

Windows are spread over the documents evenly (window `k` of `n` comes from document `floor(k * D / n)`), so a
small budget still samples every era / author of a corpus rather than only the first file. The same
arguments always give the same windows.
"""

from __future__ import annotations

import torch


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


__all__ = ["random_windows", "token_windows"]
