"""Mixed precision on CPU: bf16 autocast, about twice as fast as float32 on AMX/AVX-512 machines."""

from __future__ import annotations

import contextlib

import torch


def autocast(enabled: bool):
    """bf16 autocast on CPU, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


__all__ = ["autocast"]
