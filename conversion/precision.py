"""Mixed precision: bf16 where the hardware multiplies bf16, float32 where bf16 would be emulated.

bf16 autocast about doubles CPU training speed on machines with AMX or AVX512-BF16. Without them torch emulates
bf16 matmuls, many times slower than float32 (on an AVX2-only CPU, 0.6 against 35 GFLOP/s on one thread), so the
tool's bf16 options apply only where bf16 is native and fall back to float32 elsewhere, with one log line.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from delta_attention.modeling.delta_chunk import cpu_has_native_bf16

logger = logging.getLogger(__name__)


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """Whether bf16 matmuls run in hardware on `device`: a CUDA GPU with bf16, or a CPU with AMX or AVX512-BF16."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type != "cpu" or cpu_has_native_bf16()


@functools.cache
def warn_emulated_bf16(what: str, outcome: str = "using float32") -> None:
    """Warn once per (`what`, `outcome`) that this CPU only emulates bf16 matmuls; `outcome` says what happens."""
    logger.warning("%s: this CPU has no native bf16 matmuls (AMX, AVX512-BF16), where bf16 runs many times slower "
                   "than float32; %s", what, outcome)


def autocast(enabled: bool):
    """bf16 autocast on CPU when `enabled` and the CPU multiplies bf16 natively; otherwise nothing (float32)."""
    if enabled and not native_bf16("cpu"):
        warn_emulated_bf16("bf16 autocast")
        enabled = False
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def resolve_mixed_precision(mixed_precision: str, device: str | torch.device) -> str:
    """The training precision for `--mixed_precision`: "auto" is bf16 where `device` has native bf16, "no"
    (float32) elsewhere; any other value is kept as given."""
    if mixed_precision != "auto":
        return mixed_precision
    if native_bf16(device):
        return "bf16"
    if torch.device(device).type == "cpu":
        warn_emulated_bf16("--mixed_precision auto")
    return "no"


CPU_MIXED_PRECISIONS = ("auto", "bf16", "no")  # what the CPU benchmarks and the sweep accept


def check_cpu_mixed_precision(mixed_precision: str) -> None:
    """Raise a `ValueError` naming `--mixed_precision` unless it is one of `CPU_MIXED_PRECISIONS`."""
    if mixed_precision not in CPU_MIXED_PRECISIONS:
        raise ValueError(f"--mixed_precision must be {', '.join(CPU_MIXED_PRECISIONS[:-1])} or "
                         f"{CPU_MIXED_PRECISIONS[-1]}, got {mixed_precision!r}")


__all__ = ["autocast", "check_cpu_mixed_precision", "native_bf16", "resolve_mixed_precision", "warn_emulated_bf16"]
