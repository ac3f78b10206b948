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

Only float32 on a CPU with MKL, without autograd and outside `torch.compile`; everything else, and
`DeltaLinear.few_rows = False`, takes `F.linear` (the reference: the two agree to float32 rounding, since only
the order of the sums differs; tests/test_few_rows_linear.py).
"""

from __future__ import annotations

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


def row_range(weight: torch.Tensor) -> tuple[int, int]:
    """The fewest and the most rows `few_rows_linear` takes as weight @ x^T for `weight` [out, in]."""
    if weight.numel() * weight.element_size() < LARGE_WEIGHT_BYTES:
        return 2, FEW_ROWS
    return (1 if weight.shape[-1] <= SHORT_ROW else 2), LARGE_ROWS


def takes_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` computes x [..., in] @ weight [out, in]^T as weight @ x^T."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.dim() == 2 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and torch.backends.mkl.is_available()):
        return False
    fewest, most = row_range(weight)
    return fewest * x.shape[-1] <= x.numel() <= most * x.shape[-1]


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, taken as weight @ x^T (an odd count of rows padded with a zero row) where
    `takes_few_rows` says so. x [..., in], weight [out, in], bias [out] -> [..., out]."""
    if not takes_few_rows(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    count = rows.shape[0]
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
