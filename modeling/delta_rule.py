"""Delta-rule entry points: `chunk_delta_rule` (prefill, training) and `recurrent_delta_rule` (decoding).

The kernels live in files by role, as fla separates its ops:

* `delta_reference.py`: the definition (maths, shapes, gate kinds), `delta_rule_reference` (a plain per-token
  loop, what everything else is tested against) and `chunk_delta_rule_elementwise` (the plain chunked form, also
  the exact path for per-channel decays too steep to factorise);
* `delta_chunk.py`: the fast chunked kernel for CPUs, batched over batch, heads and chunks, with its own backward;
* `delta_fla.py`: dispatch to flash-linear-attention's Triton kernels on CUDA, when installed;
* this file: the public entry points, which decide the gate kind once (`gate_kind`) and pick a kernel, and the
  in-place decode step.

See `delta_reference.py` for the recurrence and the shapes: q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H],
g (log-decay) None | [B, T, H] | [B, T, H, K], state [B, H, K, V] float32; every function returns
`(o [B, T, H, V] in v's dtype, final_state)`. GQA-shared state: q may have G times as many heads as k, v, beta, g
and the state (`delta_reference.head_groups`); query head h then reads state h // G.

Which kernel runs, and why, is logged once per distinct choice (logger `__name__`, INFO; a broken fla install on
CUDA as a WARNING): "fla kernels (CUDA)", "torch kernels: fla not installed", "torch kernels: fla import failed:
<error>", "torch kernels: float32 inputs ...", "torch kernels: tensors not on CUDA", or the exact plain chunked form
for a per-channel decay too steep for the fast kernel.
"""

from __future__ import annotations

import logging

import torch

from .delta_chunk import FAST_LOG_DECAY_FLOOR, channel_decay_fits, fast_chunk_delta_rule
from .delta_fla import fla_delta_rule, fla_unavailable
from .delta_reference import chunk_delta_rule_elementwise, delta_rule_reference, expand_decay, gate_kind
from .delta_reference import head_groups, start_state


logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # the backend choices already logged


def _log_once(message: str, level: int = logging.INFO) -> None:
    # never while torch.compile traces: a logging call breaks the graph, which `fullgraph=True` refuses (a decode step
    # compiled before any eager forward logged the choice failed that way)
    if message not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(message)
        logger.log(level, "delta rule: %s", message)


def _use_fla(q: torch.Tensor, allow_bf16: bool) -> bool:
    """Whether the "auto" implementation runs fla's kernels for these inputs; logs the choice (once) if not."""
    reason = fla_unavailable(q)
    if reason is None and q.dtype == torch.float32 and not allow_bf16:
        reason = "float32 inputs (fla would run them in bf16; allow_bf16=True opts in)"
    if reason is None:
        _log_once("fla kernels (CUDA)")
        return True
    broken = reason.startswith("fla import failed")  # on CUDA, with fla installed: worth a warning
    _log_once(f"torch kernels: {reason}", logging.WARNING if broken else logging.INFO)
    return False


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                         scale: float | None = None, *, inplace: bool = False, implementation: str = "auto",
                         allow_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for decoding: a loop over the (few) new tokens, batched matmuls over batch and heads.

    Shapes as `delta_reference.py`; GQA is read off the shapes: q [B, T, G * Hkv, K] with k [B, T, Hkv, K],
    v [B, T, Hkv, V], beta [B, T, Hkv], g [B, T, Hkv(, K)] and state [B, Hkv, K, V] shares one state per KV head
    among its G query heads (query head h reads state h // G); o is [B, T, G * Hkv, V].

    With `inplace=True` and a float32 contiguous `initial_state` that needs no gradient, the state is updated in
    place and returned as the final state (the decode step writes into the cache's own buffer: no new state per
    token), on every backend (fla's final state is copied into it). `implementation="auto"` uses fla's fused
    recurrent kernels on CUDA when they are installed and the inputs are 16-bit; float32 inputs stay on the float32
    torch loop unless `allow_bf16=True` lets fla run them in bf16 (output cast back to float32).
    """
    gate = gate_kind(g)
    groups = head_groups(q, k, v, beta, g)
    batch, seq_len, heads, key_dim = k.shape  # heads: KV heads, one state each
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
    tensors = (q, k, v, beta, g, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    inplace = (inplace and not needs_grad and initial_state is not None and initial_state.dtype == torch.float32
               and initial_state.is_contiguous())
    if implementation == "auto" and seq_len and _use_fla(q, allow_bf16):
        out, final = fla_delta_rule(q, k, v, beta, g, initial_state, scale, gate=gate, recurrent=True)
        return out, (initial_state.copy_(final) if inplace else final)
    if inplace:
        return _recurrent_inplace(q, k, v, beta, g, initial_state, scale)

    state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)
    out_dtype = v.dtype
    q = q.float() * scale
    k, v, beta = k.float(), v.float(), beta.float()
    decay = g.float().exp() if g is not None else None
    outputs = []
    for t in range(seq_len):
        if decay is not None:
            state = state * expand_decay(decay[:, t], gate)
        k_t = k[:, t].unsqueeze(-2)  # [B, Hkv, 1, K]
        v_old = k_t @ state  # [B, Hkv, 1, V]
        delta = beta[:, t, :, None, None] * (v[:, t].unsqueeze(-2) - v_old)
        state = state + k_t.transpose(-1, -2) @ delta
        q_t = q[:, t].unflatten(1, (heads, groups))  # [B, Hkv, G, K]: the queries reading this state
        outputs.append((q_t @ state).flatten(1, 2))  # [B, H, V]
    if not outputs:
        return v.new_zeros(batch, 0, heads * groups, value_dim, dtype=out_dtype), state
    return torch.stack(outputs, dim=1).to(out_dtype), state


def _recurrent_inplace(q, k, v, beta, g, state, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form updating `state` [B, Hkv, K, V] (float32, contiguous) in place; no autograd.
    q [B, T, G * Hkv, K], the rest per KV head."""
    batch, seq_len, heads, key_dim = k.shape
    groups = q.shape[2] // heads
    value_dim = v.shape[-1]
    flat = state.view(batch * heads, key_dim, value_dim)
    out = torch.empty(batch, seq_len, heads * groups, value_dim, dtype=v.dtype, device=v.device)
    for t in range(seq_len):
        # per head decay [B, Hkv] -> [BHkv, 1, 1]; per channel [B, Hkv, K] -> [BHkv, K, 1]
        decay = None if g is None else g[:, t].reshape(batch * heads, -1, 1).float().exp()
        o_t = delta_step_inplace(
            flat,
            q[:, t].reshape(batch * heads, groups, key_dim).float(),  # the G queries of each KV head
            k[:, t].reshape(batch * heads, 1, key_dim).float(),
            v[:, t].reshape(batch * heads, 1, value_dim).float(),
            beta[:, t].reshape(batch * heads, 1, 1).float(),
            decay,
        )
        torch.mul(o_t.view(batch, heads * groups, value_dim), scale, out=out[:, t])
    return out, state


def delta_step_inplace(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                       decay: torch.Tensor | None = None) -> torch.Tensor:
    """One token of the delta rule on `state` [N, K, V] (N = batch * KV heads; float32, contiguous), in place; no
    autograd. q [N, G, K] (the G queries reading each state, scaled as wanted), k [N, 1, K], v [N, 1, V],
    beta [N, 1, 1], decay (factors, not logs) None | [N, 1, 1] per head | [N, K, 1] per channel; all float32.
    Returns o [N, G, V] = q S after the update."""
    if decay is not None:
        state.mul_(decay)
    delta = torch.baddbmm(v, k, state, alpha=-1).mul_(beta)  # b (v - S^T k): [N, 1, V]
    state.baddbmm_(k.mT, delta)  # S += k delta^T, a rank-one update in place
    return torch.bmm(q, state)


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     scale: float | None = None, chunk_size: int = 64, *, implementation: str = "auto",
                     allow_bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise delta rule (WY / UT transform) for prefill and training; differentiable.

    Shapes as `delta_reference.py`; GQA is read off the shapes, as in `recurrent_delta_rule`: q [B, T, G * Hkv, K]
    with k, v, beta, g and the state per KV head gives o [B, T, G * Hkv, V], query head h reading state h // G.

    `implementation`: `"auto"` runs fla's Triton kernels on CUDA when flash-linear-attention is installed and the
    inputs are 16-bit, and the fast batched kernel of `delta_chunk.py` otherwise; `"fast"` forces the latter,
    `"elementwise"` the plain chunked form with autograd through it. Exactness first, on every device:
    * a per-channel decay too steep for the fast kernel's (and fla's) factorised scores (a sub-block of 16 tokens
      decaying by more than e^-60 in some channel) takes the plain chunked form, exact for any decay;
    * float32 inputs run the float32 torch kernels; `allow_bf16=True` lets fla run them in bf16 on CUDA instead
      (output cast back to float32, relative error about 1e-2).
    """
    gate = gate_kind(g)
    groups = head_groups(q, k, v, beta, g)
    batch, seq_len, heads, key_dim = k.shape  # heads: KV heads, one state each
    value_dim = v.shape[-1]
    start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
    if implementation not in ("auto", "fast", "elementwise"):
        raise ValueError(f"implementation must be 'auto', 'fast' or 'elementwise', got {implementation!r}")
    if seq_len == 0:
        state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)
        return v.new_zeros(batch, 0, heads * groups, value_dim), state
    if gate == "channel" and implementation != "elementwise" and not channel_decay_fits(g, chunk_size):
        _log_once("plain chunked form (exact but several times slower): a per-channel decay too steep for the fast "
                  "kernel's factorised scores (> e^-60 per 16 tokens); set the config's `linear_log_decay_floor` "
                  f"(e.g. {FAST_LOG_DECAY_FLOOR}) to bound it", logging.WARNING)
        implementation = "elementwise"
    if implementation == "auto" and _use_fla(q, allow_bf16):
        return fla_delta_rule(q, k, v, beta, g, initial_state, scale, gate=gate)
    if implementation == "elementwise":
        return chunk_delta_rule_elementwise(q, k, v, beta, g, initial_state, scale, chunk_size, gate=gate)
    return fast_chunk_delta_rule(q, k, v, beta, g, initial_state, scale, chunk_size, gate=gate)


__all__ = ["chunk_delta_rule", "delta_rule_reference", "delta_step_inplace", "gate_kind", "recurrent_delta_rule"]
