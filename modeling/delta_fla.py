"""Optional dispatch to flash-linear-attention's Triton kernels on CUDA (`pip install delta-attention[gpu]`).

Everything here is optional: without `fla` (or without CUDA) `fla_available` is False and the pure PyTorch
kernels (`delta_chunk.py`, `delta_rule.py`) run. The entry points take and return exactly what ours do:
q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H], g None | [B, T, H] | [B, T, H, K] (log-decay),
state [B, H, K, V] float32.
fla's chunk kernels want 16-bit q/k/v, so float32 inputs are run in bfloat16 and the output cast back;
the state stays float32 in the [K, V] layout (fla's `state_v_first=False`, passed explicitly where the installed
version knows that argument, since some versions store it [V, K]).
"""

from __future__ import annotations

import inspect

import torch


try:  # optional accelerator: the remote-code import check skips imports inside try/except
    from fla.ops.delta_rule import chunk_delta_rule as _fla_chunk_delta
    from fla.ops.delta_rule import fused_recurrent_delta_rule as _fla_recurrent_delta
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk_gated
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as _fla_recurrent_gated

    try:
        from fla.ops.kda import chunk_kda as _fla_chunk_kda
        from fla.ops.kda import fused_recurrent_kda as _fla_recurrent_kda
    except ImportError:  # fla versions before KDA
        _fla_chunk_kda = _fla_recurrent_kda = None
    _FLA_IMPORTED = True
except Exception:  # not installed, or no Triton/CUDA toolchain
    _FLA_IMPORTED = False


def fla_available(tensor: torch.Tensor) -> bool:
    """Whether fla's kernels can run on `tensor`'s device."""
    return _FLA_IMPORTED and tensor.is_cuda


def _state_layout_kwargs(function) -> dict:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
    for name in ("state_v_first", "transpose_state_layout"):
        if name in parameters:
            return {name: False}
    return {}


def fla_delta_rule(q, k, v, beta, g=None, initial_state=None, scale=None, *, gate: str, recurrent: bool = False):
    """Our delta rule through fla: chunked kernels for prefill/training, fused recurrent ones for decoding.

    `gate` is the entry point's `gate_kind(g)`: "none" (DeltaNet kernels), "scalar" (gated DeltaNet) or
    "channel" (KDA)."""
    if gate == "none":
        function = _fla_recurrent_delta if recurrent else _fla_chunk_delta
        decay = {}
    elif gate == "channel":
        function = _fla_recurrent_kda if recurrent else _fla_chunk_kda
        if function is None:
            raise RuntimeError("the installed flash-linear-attention has no KDA kernels; upgrade it")
        decay = {"g": g.float()}
    else:
        function = _fla_recurrent_gated if recurrent else _fla_chunk_gated
        decay = {"g": g.float()}
    dtype = v.dtype
    compute = torch.bfloat16 if q.dtype == torch.float32 else q.dtype
    state = None if initial_state is None else initial_state.float().contiguous()
    out, final = function(
        q=q.to(compute).contiguous(),
        k=k.to(compute).contiguous(),
        v=v.to(compute).contiguous(),
        beta=beta.to(compute).contiguous(),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=state,
        output_final_state=True,
        **decay,
        **_state_layout_kwargs(function),
    )
    return out.to(dtype), final.float()
