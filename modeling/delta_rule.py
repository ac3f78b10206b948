"""Delta-rule kernels in plain PyTorch.

Three entry points compute the same thing:

* `delta_rule_reference`: a plain per-token loop, the definition everything else is tested against;
* `recurrent_delta_rule`: the recurrent form used for decoding one (or a few) tokens;
* `chunk_delta_rule`: the chunkwise (WY / UT transform) form used for prefill and training.

`chunk_delta_rule` runs the fast CPU kernel of `delta_chunk.py` (batched over batch, heads and chunks, with its
own chunked backward) and, on CUDA with flash-linear-attention installed, fla's Triton kernels
(`delta_fla.py`). `_chunk_delta_rule_elementwise` below is the plain chunked form, kept as a second reference
and as the exact path for per-channel decays too steep to factorise. `recurrent_delta_rule(..., inplace=True)`
is the decode step: it updates the cache's state buffer in place.

Per head, with `q` and `k` already L2-normalised by the caller, `q` scaled by `scale` and the state
`S` of shape [K, V]:

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,      o_t = S_t^T q_t

`g` is the log-decay: `None` (DeltaNet, no decay), one value per head (Gated DeltaNet) or one value per
key channel (KDA, "Kimi delta attention").

Shapes (fla's layout):
    q, k:  [B, T, H, K]
    v:     [B, T, H, V]
    beta:  [B, T, H]
    g:     None, [B, T, H] or [B, T, H, K]
    state: [B, H, K, V], always float32
Every function returns `(o, final_state)` with `o` of shape [B, T, H, V] in `v`'s dtype.
State and accumulation are float32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from .delta_chunk import channel_decay_fits, fast_chunk_delta_rule
from .delta_fla import fla_available, fla_delta_rule


def _expand_decay(decay: torch.Tensor) -> torch.Tensor:
    """Shape a per-head [B, H] or per-channel [B, H, K] decay to broadcast over a [B, H, K, V] state."""
    return decay[..., None, None] if decay.dim() == 2 else decay[..., None]


def _initial_state(
    initial_state: torch.Tensor | None, batch: int, heads: int, key_dim: int, value_dim: int, device
) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=device)
    expected = (batch, heads, key_dim, value_dim)
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {expected} (B, H, K, V)")
    return initial_state.float()


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time, written as the definition reads. Slow; for tests."""
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    state = _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device).clone()
    outputs = []
    for t in range(seq_len):
        if g is not None:
            state = state * _expand_decay(g[:, t].float().exp())
        k_t, v_t, q_t = k[:, t].float(), v[:, t].float(), q[:, t].float() * scale
        v_old = torch.einsum("bhkv,bhk->bhv", state, k_t)  # what the memory returns for k_t
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, t, :, None].float() * (v_t - v_old))
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q_t))
    return torch.stack(outputs, dim=1).to(v.dtype), state


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    inplace: bool = False,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent form for decoding: a loop over the (few) new tokens, batched matmuls over batch and heads.

    With `inplace=True` and a float32 contiguous `initial_state` that needs no gradient, the state is updated in
    place and returned as the final state (the decode step writes into the cache's own buffer: no new state per
    token). `implementation="auto"` uses fla's fused recurrent kernels on CUDA when they are installed.
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    if implementation == "auto" and seq_len and fla_available(q):
        _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
        return fla_delta_rule(q, k, v, beta, g, initial_state, scale, recurrent=True)
    tensors = (q, k, v, beta, g, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if inplace and not needs_grad and initial_state is not None and initial_state.dtype == torch.float32:
        _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
        if initial_state.is_contiguous():
            return _recurrent_inplace(q, k, v, beta, g, initial_state, scale)

    state = _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)
    q = q.float() * scale
    k, v, beta = k.float(), v.float(), beta.float()
    decay = g.float().exp() if g is not None else None
    outputs = []
    for t in range(seq_len):
        if decay is not None:
            state = state * _expand_decay(decay[:, t])
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


def _causal_mask(size: int, inclusive: bool, device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(0 if inclusive else -1)


def _decayed_scores(
    x: torch.Tensor, y: torch.Tensor, log_decay: torch.Tensor | None, inclusive: bool, block: int = 16
) -> torch.Tensor:
    """Causal scores within each chunk: out[t, i] = sum_d x_t[d] y_i[d] exp(G_t - G_i) for i < t (or i <= t).

    x, y: [..., C, K]; log_decay: None, [..., C] (per head) or [..., C, K] (per channel), cumulative within
    the chunk. Decay exponents are only ever evaluated where they are <= 0, so no overflow for any decay.
    For the per-channel case, pairs inside a sub-block of `block` tokens are weighted explicitly; pairs
    across sub-blocks factor through the end of the earlier sub-block, giving matmuls.
    """
    chunk = x.shape[-2]
    mask = _causal_mask(chunk, inclusive, x.device)
    if log_decay is None:
        return (x @ y.transpose(-1, -2)).masked_fill(~mask, 0.0)
    if log_decay.dim() == x.dim() - 1:  # one decay per head
        exponent = log_decay[..., :, None] - log_decay[..., None, :]
        weights = torch.where(mask, exponent, float("-inf")).exp()
        return (x @ y.transpose(-1, -2)) * weights

    sub = block if chunk % block == 0 else chunk
    n_sub = chunk // sub
    xs, ys, gs = (t.unflatten(-2, (n_sub, sub)) for t in (x, y, log_decay))  # [..., n_sub, sub, K]
    sub_mask = _causal_mask(sub, inclusive, x.device)
    exponent = gs[..., :, None, :] - gs[..., None, :, :]  # [..., n_sub, sub, sub, K]
    weights = torch.where(sub_mask[..., None], exponent, float("-inf")).exp()
    diagonal = (xs[..., :, None, :] * ys[..., None, :, :] * weights).sum(-1)  # [..., n_sub, sub, sub]

    columns = []
    for b in range(n_sub):
        parts = []
        if b > 0:
            parts.append(x.new_zeros(*x.shape[:-2], b * sub, sub))
        parts.append(diagonal[..., b, :, :])
        if b < n_sub - 1:
            reference = gs[..., b, -1:, :]  # log-decay at the end of sub-block b
            later = slice((b + 1) * sub, None)
            left = x[..., later, :] * (log_decay[..., later, :] - reference).exp()
            right = ys[..., b, :, :] * (reference - gs[..., b, :, :]).exp()
            parts.append(left @ right.transpose(-1, -2))
        columns.append(torch.cat(parts, dim=-2))
    return torch.cat(columns, dim=-1)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    *,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise delta rule (WY / UT transform) for prefill and training; differentiable.

    `implementation`: `"auto"` runs fla's Triton kernels on CUDA when flash-linear-attention is installed and the
    fast batched kernel of `delta_chunk.py` otherwise; `"fast"` forces the latter, `"elementwise"` the plain
    chunked form with autograd through it (also what `"auto"`/`"fast"` use for a per-channel decay too steep for
    the fast kernel's factorised scores: a sub-block of 16 tokens decaying by more than e^-60 in some channel).
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # shape check
    if implementation not in ("auto", "fast", "elementwise"):
        raise ValueError(f"implementation must be 'auto', 'fast' or 'elementwise', got {implementation!r}")
    if seq_len == 0:
        state = _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)
        return v.new_zeros(batch, 0, heads, value_dim), state
    if implementation == "auto" and fla_available(q):
        return fla_delta_rule(q, k, v, beta, g, initial_state, scale)
    steep = g is not None and g.dim() == 4 and not channel_decay_fits(g, chunk_size)
    if implementation == "elementwise" or steep:
        return _chunk_delta_rule_elementwise(q, k, v, beta, g, initial_state, scale, chunk_size)
    return fast_chunk_delta_rule(q, k, v, beta, g, initial_state, scale, chunk_size)


def _chunk_delta_rule_elementwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise form written plainly (float32, a loop over chunks, autograd through it); exact for any decay.

    Within a chunk of C tokens with cumulative log-decay G:
        T = (I + tril(diag(b) (K K^T . Gamma), -1))^{-1}     (one batched unit-triangular solve)
        U = T diag(b) V,    W = T diag(b) (K . exp(G))
    and across chunks, with S the state entering the chunk:
        V' = U - W S,   O = (Q . exp(G)) S + (Q K^T . Gamma . causal) V',
        S <- exp(G_C) S + (K . exp(G_C - G))^T V'
    """
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    state = _initial_state(initial_state, batch, heads, key_dim, value_dim, q.device)
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads, value_dim), state

    chunk = chunk_size
    pad = (-seq_len) % chunk
    n_chunks = (seq_len + pad) // chunk

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, H, N, C, ...], float32, zero-padded at the end (padded tokens leave S unchanged)
        x = x.float().movedim(2, 1)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(batch, heads, n_chunks, chunk, *x.shape[3:])

    q_c, k_c, v_c = to_chunks(q) * scale, to_chunks(k), to_chunks(v)  # [B, H, N, C, K|V]
    beta_c = to_chunks(beta)  # [B, H, N, C]
    log_decay = to_chunks(g).cumsum(3) if g is not None else None  # [B, H, N, C] or [B, H, N, C, K]

    if log_decay is None:
        decay_in = decay_to_end = decay_chunk = None
        q_decayed, k_decayed, k_to_end = q_c, k_c, k_c
    else:
        channel = log_decay.dim() == 5
        last = log_decay[:, :, :, -1:]  # [B, H, N, 1(, K)]
        decay_in = log_decay.exp() if channel else log_decay.exp()[..., None]
        decay_to_end = (last - log_decay).exp() if channel else (last - log_decay).exp()[..., None]
        decay_chunk = last.squeeze(3).exp()  # [B, H, N(, K)]
        q_decayed, k_decayed, k_to_end = q_c * decay_in, k_c * decay_in, k_c * decay_to_end

    # UT transform: (I + strict_tril(diag(b) K K^T . Gamma)) [U | W] = diag(b) [V | K . exp(G)]
    kk = _decayed_scores(k_c, k_c, log_decay, inclusive=False) * beta_c[..., None]
    rhs = beta_c[..., None] * torch.cat([v_c, k_decayed], dim=-1)
    solved = torch.linalg.solve_triangular(kk, rhs, upper=False, unitriangular=True)
    u, w = solved.split([value_dim, key_dim], dim=-1)
    qk = _decayed_scores(q_c, k_c, log_decay, inclusive=True)  # [B, H, N, C, C]

    outputs = []
    for n in range(n_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state  # [B, H, C, V]
        outputs.append(q_decayed[:, :, n] @ state + qk[:, :, n] @ v_new)
        if decay_chunk is not None:
            state = state * _expand_decay(decay_chunk[:, :, n])
        state = state + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).reshape(batch, heads, n_chunks * chunk, value_dim)[:, :, :seq_len]
    return o.movedim(1, 2).to(v.dtype), state
