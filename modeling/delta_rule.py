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
`(o [B, T, H, V] in v's dtype, final_state)`.
"""

from __future__ import annotations

import torch

from .delta_chunk import channel_decay_fits, fast_chunk_delta_rule
from .delta_fla import fla_available, fla_delta_rule
from .delta_reference import chunk_delta_rule_elementwise, delta_rule_reference, expand_decay, gate_kind, start_state


def recurrent_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                         scale: float | None = None, *, inplace: bool = False, implementation: str = "auto"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for decoding: a loop over the (few) new tokens, batched matmuls over batch and heads.

    With `inplace=True` and a float32 contiguous `initial_state` that needs no gradient, the state is updated in
    place and returned as the final state (the decode step writes into the cache's own buffer: no new state per
    token). `implementation="auto"` uses fla's fused recurrent kernels on CUDA when they are installed.
    """
    gate = gate_kind(g)
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    if implementation == "auto" and seq_len and fla_available(q):
        start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
        return fla_delta_rule(q, k, v, beta, g, initial_state, scale, gate=gate, recurrent=True)
    tensors = (q, k, v, beta, g, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if inplace and not needs_grad and initial_state is not None and initial_state.dtype == torch.float32:
        start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
        if initial_state.is_contiguous():
            return _recurrent_inplace(q, k, v, beta, g, initial_state, scale)

    state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)
    q = q.float() * scale
    k, v, beta = k.float(), v.float(), beta.float()
    decay = g.float().exp() if g is not None else None
    outputs = []
    for t in range(seq_len):
        if decay is not None:
            state = state * expand_decay(decay[:, t], gate)
        k_t = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
        v_old = k_t @ state  # [B, H, 1, V]
        delta = beta[:, t, :, None, None] * (v[:, t].unsqueeze(-2) - v_old)
        state = state + k_t.transpose(-1, -2) @ delta
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    if not outputs:
        return v.new_zeros(batch, 0, heads, value_dim), state
    return torch.stack(outputs, dim=1).to(v.dtype), state


def _recurrent_inplace(q, k, v, beta, g, state, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrent form updating `state` [B, H, K, V] (float32, contiguous) in place; no autograd."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    flat = state.view(batch * heads, key_dim, value_dim)
    out = torch.empty(batch, seq_len, heads, value_dim, dtype=v.dtype, device=v.device)
    for t in range(seq_len):
        k_t = k[:, t].reshape(batch * heads, 1, key_dim).float()  # [BH, 1, K]
        if g is not None:  # per head [B, H] -> [BH, 1, 1]; per channel [B, H, K] -> [BH, K, 1]
            flat.mul_(g[:, t].reshape(batch * heads, -1, 1).float().exp())
        delta = v[:, t].reshape(batch * heads, 1, value_dim).float() - torch.bmm(k_t, flat)  # [BH, 1, V]
        delta.mul_(beta[:, t].reshape(batch * heads, 1, 1))
        flat.baddbmm_(k_t.mT, delta)  # S += k (b (v - S^T k))^T, a rank-one update in place
        q_t = q[:, t].reshape(batch * heads, 1, key_dim).float()
        torch.mul(torch.bmm(q_t, flat).view(batch, heads, value_dim), scale, out=out[:, t])
    return out, state


def chunk_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     scale: float | None = None, chunk_size: int = 64, *, implementation: str = "auto"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise delta rule (WY / UT transform) for prefill and training; differentiable.

    `implementation`: `"auto"` runs fla's Triton kernels on CUDA when flash-linear-attention is installed and the
    fast batched kernel of `delta_chunk.py` otherwise; `"fast"` forces the latter, `"elementwise"` the plain
    chunked form with autograd through it (also what `"auto"`/`"fast"` use for a per-channel decay too steep for
    the fast kernel's factorised scores: a sub-block of 16 tokens decaying by more than e^-60 in some channel).
    """
    gate = gate_kind(g)
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
    if implementation not in ("auto", "fast", "elementwise"):
        raise ValueError(f"implementation must be 'auto', 'fast' or 'elementwise', got {implementation!r}")
    if seq_len == 0:
        state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)
        return v.new_zeros(batch, 0, heads, value_dim), state
    if implementation == "auto" and fla_available(q):
        return fla_delta_rule(q, k, v, beta, g, initial_state, scale, gate=gate)
    steep = gate == "channel" and not channel_decay_fits(g, chunk_size)
    if implementation == "elementwise" or steep:
        return chunk_delta_rule_elementwise(q, k, v, beta, g, initial_state, scale, chunk_size, gate=gate)
    return fast_chunk_delta_rule(q, k, v, beta, g, initial_state, scale, chunk_size, gate=gate)


__all__ = ["chunk_delta_rule", "delta_rule_reference", "gate_kind", "recurrent_delta_rule"]
