"""Helpers of `DeltaForCausalLM.prefill`, the explicit path for long prompts (docs/design.md, "Long prompts in pieces").

A delta layer carries its whole past in a fixed-size state, so a prompt can run through the model a piece at a
time, each piece continuing from the cache the previous one filled. Only the hidden states whose logits are
asked for (`logits_to_keep`) are kept (`KeptHidden`). Peak memory then depends on the piece length, not on the
prompt length (for an all-delta model; softmax layers of a hybrid still grow their KV cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand the pages that freed tensors leave inside glibc's heap back to the OS (`malloc_trim`; a no-op where
    there is no glibc). Between pieces this keeps the resident size flat: without it, glibc's heap fragments over
    hundreds of pieces and the RSS creeps up (measured +13% from 8k to 256k tokens) although no tensor grows."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class KeptHidden:
    """Collects, piece by piece, the hidden states of the positions `logits_to_keep` selects out of `seq_len`.

    An int keeps the last `logits_to_keep` positions (0: all of them); a 1D tensor the given positions, returned
    in the order asked (negative ones count from the end)."""

    def __init__(self, logits_to_keep: int | torch.Tensor, seq_len: int, device):
        if isinstance(logits_to_keep, int):
            self.first = 0 if logits_to_keep == 0 else max(seq_len - logits_to_keep, 0)
            self.positions = None
        else:
            self.first = None
            self.positions = logits_to_keep.to(device) % seq_len
        self.parts, self.order = [], []

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """Keep what is asked of `hidden` [B, piece, hidden], the piece that starts at position `start`."""
        if self.positions is None:
            if start + hidden.shape[1] > self.first:
                self.parts.append(hidden[:, max(self.first - start, 0) :])
            return
        inside = (self.positions >= start) & (self.positions < start + hidden.shape[1])
        inside = torch.nonzero(inside).squeeze(-1)  # indices into positions
        self.parts.append(hidden[:, self.positions[inside] - start])
        self.order.append(inside)

    def result(self) -> torch.Tensor:
        """The kept hidden states [B, kept, hidden]."""
        hidden = torch.cat(self.parts, dim=1)
        if self.positions is None:
            return hidden
        ordered = hidden.new_empty(hidden.shape[0], self.positions.shape[0], hidden.shape[-1])
        ordered[:, torch.cat(self.order)] = hidden  # back to the order the positions were asked in
        return ordered
