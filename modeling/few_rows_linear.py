"""Linear layers on a few rows at CPU inference: a speculative verification, a small batch's decode step
(docs/design.md, "Few-row matmuls").

`F.linear` on 2-4 rows in float32 goes to MKL's sgemm as x @ W^T, which on the 2-core AVX2 machine this was
measured on costs 1.6-2x the one-row product (a gemv) for SmolLM2's weights, although both read each weight
from memory once and that read is the cost. The same product taken as W @ x^T (the weight the left operand, x^T
strided) with an even number of rows reads the weights at full speed: 2 or 4 rows cost 0.7-0.8x what one row
costs through `F.linear` (1.15x for the MLP's down projection, still half its x @ W^T time). So `few_rows_linear`
computes 2 to `FEW_ROWS` rows that way, 3 padded with a zero row to 4: a forward of 4 tokens through a
SmolLM2-sized hybrid took 108 ms against 172 (one token: 85), so a verification of three drafted tokens costs
little more than a decode step. One row stays a gemv (but see below): padded to two it measured 0.95x for the
whole SmolLM2 model but 1.6-2.4x for weights that fit in the cache.

A large weight (`LARGE_WEIGHT_BYTES`, 32 MiB and up: an LM head over a vocabulary, the MLP of a billion-parameter
model) is read from memory whatever the rows, and there W @ x^T stays about half the x @ W^T time up to
`LARGE_ROWS` (16) rows: SmolLM2's 49,152 x 576 LM head on 11 rows (a verification of 10 drafted tokens) took
31.6 ms against 62.3, a 14,336 x 4,096 projection 65.4 against 127.8. So large weights take the path for 2 to 16
rows (odd counts padded with a zero row), the others for 2 to 4. A large weight with short rows (at most
`SHORT_ROW`, 2,048 inputs) takes it for one row as well, padded to two: there MKL's one-row gemv is slow too
(SmolLM2's head 17.6 ms against 12.8 as W @ x^T, Qwen2's 151,936 x 896 head 65.5 against 46.8, while a 14,336 x
4,096 projection's gemv beat W @ x^T, 19.1 against 22.3), so a one-token decode step reads its LM head faster.

Those rules are the AMD EPYC's, and MKL, which picks its kernels by CPU vendor, behaves the other way on Intel: on a
2-core Intel Xeon with AMX, float32 weight @ x^T took up to twice `F.linear`'s time on 1 to 6 rows for every weight
of SmolLM2 read from memory (stacks of 30 weights of a shape, cache flushed: the LM head 12.6 against 5.5 ms on one
row, the 1,536 x 576 projection 380 against 190 us; on 4 rows 362 against 252) and won only on the LM head from 8
rows (12.2 against 17.8 ms at 8, 12.6 against 23.9 at 11; equal at 6 and 16). The one-row rule for the head alone
cost the all-delta model 8.5 ms of a 55 ms decode step there. So on an Intel CPU (`cpu_vendor`) float32 takes the
path only for large weights on `INTEL_LARGE_FEWEST` (8) to `LARGE_ROWS` rows; elsewhere the rules above.

bf16 on a CPU (`BF16_ROWS`): on the Xeon a bf16 `F.linear` of 1 to 64 rows carries about 20 us of fixed cost per
call (9 x 576: 22.7 against 2.6 us in float32) and reads a weight from memory slower than the float32 gemv does,
which made a bf16 model decode slower than its float32 copy. One row as a matrix-vector product (`torch.addmv`)
and 2 to `BF16_ROWS` rows as weight @ x^T (`torch.addmm`, no padding) read faster (model-sized stacks, one row: the
1,536 x 576 projection 65 against 86 us, 576 x 576 40 against 48, the LM head 3.5 against 5.1 ms; 2 to 32 rows
1.3-1.6x faster for every weight of 576 x 576 and up, equal below). Both sum in float32 with the bias inside and
round once, as `F.linear` does: equal to it on SmolLM2's shapes, and to bf16 rounding elsewhere (a sum in another
order can round a last bit the other way).

Only float32 on a CPU with MKL, or bf16 on a CPU, without autograd and outside `torch.compile`; everything else,
and `DeltaLinear.few_rows = False`, takes `F.linear` (the reference: in float32 the two agree to float32 rounding,
since only the order of the sums differs; tests/test_few_rows_linear.py).
"""

from __future__ import annotations

import functools
import platform

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import PackedWeight, packed_linear, takes_packed

# the rows (tokens of a batch, all rows together) taken as W @ x^T; above 4, x @ W^T was as fast or faster for
# most of SmolLM2's weights, and one row is a gemv (large weights: below)
FEW_ROWS = 4
# weights of at least this many bytes (far larger than a CPU's caches) take the path for up to LARGE_ROWS rows,
# and for one row too when their rows are short (at most SHORT_ROW inputs: an LM head over a vocabulary)
LARGE_WEIGHT_BYTES = 32 * 2**20
LARGE_ROWS = 16
SHORT_ROW = 2048


# float32 on an Intel CPU: large weights only, from this many rows (to LARGE_ROWS); fewer rows, and any small
# weight, measured faster through `F.linear` there
INTEL_LARGE_FEWEST = 8
# bf16: the most rows taken as weight @ x^T (one row as a matrix-vector product); above, `F.linear`
BF16_ROWS = 32


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as the processor names itself ("GenuineIntel", "AuthenticAMD"), or "" where unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "GenuineIntel" if "Intel" in platform.processor() else ""


def row_range(weight: torch.Tensor) -> tuple[int, int] | None:
    """The fewest and the most rows `few_rows_linear` takes as weight @ x^T for `weight` [out, in] on this CPU, or
    None where it takes none."""
    if weight.dtype == torch.bfloat16:
        return 1, BF16_ROWS
    large = weight.numel() * weight.element_size() >= LARGE_WEIGHT_BYTES
    if cpu_vendor() == "GenuineIntel":
        return (INTEL_LARGE_FEWEST, LARGE_ROWS) if large else None
    if not large:
        return 2, FEW_ROWS
    return (1 if weight.shape[-1] <= SHORT_ROW else 2), LARGE_ROWS


def takes_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` computes x [..., in] @ weight [out, in]^T as weight @ x^T."""
    if not (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype
            and weight.dim() == 2 and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return False
    if not (x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and torch.backends.mkl.is_available())):
        return False
    rows = row_range(weight)
    return rows is not None and rows[0] * x.shape[-1] <= x.numel() <= rows[1] * x.shape[-1]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, taken as weight @ x^T where `takes_few_rows` says so (float32: an odd count of
    rows padded with a zero row; bf16: one row as a matrix-vector product, the bias inside the product, one rounding
    as in `F.linear`). x [..., in], weight [out, in], bias [out] -> [..., out]."""
    if not takes_few_rows(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    count = rows.shape[0]
    if weight.dtype == torch.bfloat16:
        if count == 1:
            output = weight @ rows[0] if bias is None else torch.addmv(bias, weight, rows[0])  # [out]
        else:
            output = (weight @ rows.t() if bias is None else torch.addmm(bias[:, None], weight, rows.t())).t()
        return output.reshape(*x.shape[:-1], weight.shape[0])
    if count % 2:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    output = (weight @ rows.t()).t()[:count]  # [out, R] -> [R, out]
    if bias is not None:
        output = output + bias
    return output.reshape(*x.shape[:-1], weight.shape[0])


class DeltaLinear(nn.Linear):
    """`nn.Linear` (same parameters, names and maths) whose forward takes `few_rows_linear`; `few_rows = False`
    (on the class or a layer) keeps `F.linear` everywhere. A layer given a packed copy of its weight
    (`packed_linear.pack_linear_weights`, an opt-in) multiplies through it where `takes_packed` allows."""

    few_rows = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.__dict__.get("packed_weight")
        if packed is not None and takes_packed(x, self.weight):
            if not packed.is_current(self.weight):  # the weight changed (or the layer was copied): pack it again
                packed = self.packed_weight = PackedWeight(self.weight)
            return packed_linear(x, packed, self.bias)
        if self.few_rows:
            return few_rows_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
