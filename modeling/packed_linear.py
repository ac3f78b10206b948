"""Linear layers on oneDNN's prepacked weights at CPU inference, an opt-in (docs/design.md, "Packed weights").

`F.linear` in float32 on a CPU goes to MKL's sgemm, which lays the weight out for its kernels again at every call;
on a few rows (a decode step, a speculative verification) that costs as much as the product. oneDNN, which torch
ships for CPUs, can lay a weight out once (`torch.ops.mkldnn._reorder_linear_weight`) and then multiply any number
of rows by it (`torch.ops.mkldnn._linear_pointwise`). On the 2-core AVX2 machine of the benchmarks, for SmolLM2's
weights: the 49,152 x 576 LM head took 4.6 ms for one row against 8.4 through `F.linear` and 8.3 for 11 rows
against 30.4; the MLP's 1,536 x 576 projection 84 against 102 us for one row, 199 against 313 for 11. Smaller
weights (576 x 576 and below) were slower on one row (54 against 35 us), so only weights of `MIN_PACKED_BYTES`
and up are packed.

The price is memory: a packed weight is a second copy of the weight (about 0.43 GB more for SmolLM2-135M, 80% of
its weights), which is why it is an opt-in: `model.pack_linear_weights()` packs, `model.unpack_linear_weights()`
frees the copies. A packed layer multiplies through its copy only at inference (no autograd, float32 CPU input,
at most `PACKED_ROWS` rows: beyond that sgemm is as fast) and while its weight is the one packed, unchanged (same
storage and version counter, which `copy_`, `load_state_dict` and optimizer steps bump); a changed weight is packed
again at its next use. Everything else takes the layer's usual path. The two agree to float32 rounding (the same
sums in another order; tests/test_packed_linear.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: weights of at least this many bytes are packed (the MLP's and the LM head in SmolLM2-sized models)
MIN_PACKED_BYTES = 2 * 2**20
#: the most rows (tokens of a batch, all rows together) that go through a packed weight
PACKED_ROWS = 64
#: the rows oneDNN lays a weight out for (a hint: 1 to 64 rows measured within 10% of each other's best)
PACKING_ROWS_HINT = 16


def packing_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds with mkldnn do)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class PackedWeight:
    """oneDNN's prepacked copy of a float32 CPU weight [out, in], and what tells whether the weight changed since."""

    def __init__(self, weight: torch.Tensor):
        with torch.no_grad():
            self.tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS_HINT)
        self.source = weight.detach()  # an alias: keeps the packed storage from being reused by another tensor
        self.version = weight._version

    def __deepcopy__(self, memo) -> PackedWeight:
        # a copy of the layer has a weight of its own: its packed copy is made at its first use (`is_current` False)
        stale = PackedWeight.__new__(PackedWeight)
        stale.tensor = stale.source = None
        stale.version = -1
        return stale

    def is_current(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the tensor packed, unchanged since."""
        return self.source is not None and (weight.data_ptr() == self.source.data_ptr() and weight._version == self.version
                and weight.shape == self.source.shape and weight.dtype == self.source.dtype)


def takes_packed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [..., in] @ weight^T may go through a packed copy of `weight`: inference, float32 on the CPU,
    1 to `PACKED_ROWS` rows, eagerly."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and 0 < x.numel() <= PACKED_ROWS * x.shape[-1])


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through the packed copy of `weight`. x [..., in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # [R, in]
    output = torch.ops.mkldnn._linear_pointwise(rows, packed.tensor, bias, "none", [], "")  # [R, out]
    return output.reshape(*x.shape[:-1], output.shape[-1])


def pack_linear_weights(model: nn.Module, linear_class: type, min_bytes: int = MIN_PACKED_BYTES) -> int:
    """Give every `linear_class` layer of `model` whose weight is float32 on the CPU and of at least `min_bytes` a
    packed copy (`PackedWeight`, kept as the layer's `packed_weight`); returns the bytes this added. Where torch has
    no oneDNN, says so in one log line and packs nothing."""
    if not packing_available():
        logger.warning("this torch build has no oneDNN packed linear (torch.ops.mkldnn); the weights stay unpacked")
        return 0
    added = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, linear_class) and weight is not None and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.numel() * weight.element_size() >= min_bytes):
            module.packed_weight = PackedWeight(weight)
            added += weight.numel() * weight.element_size()
    return added


def unpack_linear_weights(model: nn.Module) -> None:
    """Free the packed copies `pack_linear_weights` gave the layers of `model`."""
    for module in model.modules():
        module.__dict__.pop("packed_weight", None)
