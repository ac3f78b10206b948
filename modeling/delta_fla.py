"""Optional dispatch to flash-linear-attention's Triton kernels on CUDA (`pip install delta-attention[gpu]`).

Everything here is optional: without `fla` (or without CUDA) `fla_unavailable` says why and the pure PyTorch
kernels (`delta_chunk.py`, `delta_rule.py`) run; a broken install (fla present, its import failing, e.g. no Triton)
is reported with its error, not taken for "not installed". The entry points take and return exactly what ours do:
q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V], beta [B, T, Hkv], g None | [B, T, Hkv] | [B, T, Hkv, K]
(log-decay), state [B, Hkv, K, V] float32, with H = Hkv (or a multiple of it: GQA, see `fla_delta_rule`).
fla's chunk kernels want 16-bit q/k/v, so float32 inputs are run in bfloat16 and the output cast back; the entry
points only send float32 inputs here when the caller opts in (`allow_bf16=True`).
The state stays float32 in the [K, V] layout (fla's `state_v_first=False`, passed explicitly where the installed
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
    _FLA_IMPORT_ERROR = None
except Exception as error:  # not installed, or installed but broken (no Triton/CUDA toolchain, version mismatch)
    _FLA_IMPORT_ERROR = error
_FLA_IMPORTED = _FLA_IMPORT_ERROR is None


def import_failure(error: BaseException | None) -> str | None:
    """Why fla cannot be used, from the exception its import raised: "fla not installed" when the package itself
    is missing, "fla import failed: <error>" for anything else (a broken install); None for no error."""
    if error is None:
        return None
    if isinstance(error, ModuleNotFoundError) and error.name == "fla":
        return "fla not installed"
    return f"fla import failed: {type(error).__name__}: {error}"


def fla_unavailable(tensor: torch.Tensor) -> str | None:
    """None when fla's kernels can run on `tensor`'s device, otherwise why not."""
    if not tensor.is_cuda:
        return "tensors not on CUDA"
    if not _FLA_IMPORTED:
        return import_failure(_FLA_IMPORT_ERROR) or "fla not installed"
    return None


def fla_available(tensor: torch.Tensor) -> bool:
    """Whether fla's kernels can run on `tensor`'s device."""
    return fla_unavailable(tensor) is None


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
    "channel" (KDA). Returns `(o, final_state)` with a new float32 final state; the caller copies it into its
    buffer when asked to work in place.

    GQA (q with G times as many heads as k): fla's kernels want one head count, so k, v, beta, g and the initial
    state are repeated over each group and the final state is read off the first head of each group. That is the
    same computation (every head of a group carries the same state), at G times the key-side cost.
    """
    groups = q.shape[2] // k.shape[2]
    if groups > 1:  # [B, T, Hkv, ...] -> [B, T, H, ...], query head h reading KV head h // G
        k, v, beta = (x.repeat_interleave(groups, dim=2) for x in (k, v, beta))
        g = None if g is None else g.repeat_interleave(groups, dim=2)
        initial_state = None if initial_state is None else initial_state.repeat_interleave(groups, dim=1)
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
    final = final.float()
    if groups > 1:
        final = final[:, ::groups].contiguous()  # [B, H, K, V] -> [B, Hkv, K, V]
    return out.to(dtype), final
