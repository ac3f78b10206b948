"""The delta layer's short causal depthwise conv over the [q | k | v] channels, in the [B, L, D] layout.

`F.conv1d` (oneDNN on CPUs) takes 5-10 ms for one layer's 1,024 x 1,728 inputs and a kernel of 4 on two threads,
a tenth of the layer's prefill time; the same conv as K shifted multiply-adds over [B, L, D] takes 0.4 ms
(docs/design.md, "Short conv"). `causal_conv` is that, with its own backward (training runs it too);
`causal_conv_reference` is the `F.conv1d` form it is tested against (tests/test_short_conv.py).

Shapes: inputs [B, L, D] are the L positions the conv reads (cached ones first, then the new ones; any strides),
weight [D, K] (an `nn.Conv1d(D, D, K, groups=D)` weight without its middle axis), output [B, T, D] for the last T
positions: out[t] = sum_k weight[:, k] * inputs[t - (K - 1 - k)], zero before position 0 of `inputs`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_reference(inputs: torch.Tensor, weight: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`causal_conv` through `F.conv1d`: [B, L, D], [D, K] -> [B, T, D] (T = `new_tokens`)."""
    width = weight.shape[-1]
    out = F.conv1d(inputs.transpose(1, 2), weight.unsqueeze(1), padding=width - 1, groups=weight.shape[0])
    return out[..., : inputs.shape[1]][..., inputs.shape[1] - new_tokens :].transpose(1, 2)


def _shifted_sum(source: torch.Tensor, weight: torch.Tensor, new_tokens: int, reverse: bool) -> torch.Tensor:
    """The K shifted multiply-adds, accumulated in float32: sum_k weight[:, k] * source shifted by K - 1 - k
    positions towards the end (`reverse`: towards the start, the conv's transpose). source [B, L, D] -> float32
    [B, T, D], the last T positions (`reverse`: the first T)."""
    length, width = source.shape[1], weight.shape[-1]
    first = length - new_tokens if not reverse else 0  # the first output position, in `source`'s positions
    # one conversion, then float32 ops: mixed-dtype multiply-adds (16-bit source, float32 sums) take twice as long;
    # the weight as [K, D], each tap's D weights contiguous: broadcasting a strided column of the [D, K] weight made
    # every pass 3.7x slower (1,024 x 1,728 inputs, two threads: 1.1 against 0.3 ms)
    source, taps = source.float(), weight.float().t().contiguous()
    out = source[:, first : first + new_tokens] * taps[-1]  # the tap without a shift
    for tap in range(width - 1):
        shift = width - 1 - tap
        if not reverse:  # out[t] += w[tap] * source[first + t - shift], for first + t - shift >= 0
            skip = max(shift - first, 0)
            out[:, skip:].addcmul_(source[:, first + skip - shift : first + new_tokens - shift], taps[tap])
        else:  # out[t] += w[tap] * source[t + shift], for t + shift < L
            keep = min(new_tokens, length - shift)
            if keep > 0:
                out[:, :keep].addcmul_(source[:, shift : shift + keep], taps[tap])
    return out


class CausalConvFunction(torch.autograd.Function):
    """`causal_conv` with its gradients as the same shifted multiply-adds (inputs) and K channel sums (weight)."""

    @staticmethod
    def forward(ctx, inputs, weight, new_tokens):
        ctx.save_for_backward(inputs, weight)
        ctx.new_tokens = new_tokens
        return _shifted_sum(inputs, weight, new_tokens, reverse=False).to(inputs.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        inputs, weight = ctx.saved_tensors
        new_tokens, (batch, length, channels), width = ctx.new_tokens, inputs.shape, weight.shape[-1]
        first = length - new_tokens
        grad_inputs = grad_weight = None
        grad_out32 = grad_out.float()  # one conversion for both gradients, as in `_shifted_sum`
        if ctx.needs_input_grad[0]:
            # inputs[s] fed out[t] through tap K - 1 - (t + first - s): the same sum over grad_out, reversed
            padded = grad_out32
            if first:  # the cached positions fed no output of their own
                padded = grad_out32.new_zeros(batch, length, channels)
                padded[:, first:] = grad_out32
            grad_inputs = _shifted_sum(padded, weight, length, reverse=True).to(inputs.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty(width, channels, dtype=torch.float32, device=weight.device)
            inputs32 = inputs.float()
            for tap in range(width):
                shift = width - 1 - tap
                skip = max(shift - first, 0)  # outputs whose tap reads before position 0
                taps = inputs32[:, first + skip - shift : length - shift]  # [B, T - skip, D]
                grad_weight[tap] = (taps * grad_out32[:, skip:]).sum((0, 1))
            grad_weight = grad_weight.t().to(weight.dtype)
        return grad_inputs, grad_weight, None


def causal_conv(inputs: torch.Tensor, weight: torch.Tensor, new_tokens: int | None = None) -> torch.Tensor:
    """The causal depthwise conv's last `new_tokens` outputs (all L by default): [B, L, D], [D, K] -> [B, T, D], in
    the inputs' dtype (sums in float32); differentiable in both arguments."""
    new_tokens = inputs.shape[1] if new_tokens is None else new_tokens
    if not 0 <= new_tokens <= inputs.shape[1]:
        raise ValueError(f"new_tokens must be between 0 and the {inputs.shape[1]} input positions, got {new_tokens}")
    # autocast would not reach inside the Function; the conv computes in float32 and returns the inputs' dtype,
    # the dtype autocast's conv1d gives a 16-bit input
    with torch.autocast(inputs.device.type, enabled=False):
        return CausalConvFunction.apply(inputs, weight, new_tokens)
