"""The delta rule as defined: shapes, gate kinds, the per-token reference and the plain chunked form.

Per head, with `q` and `k` already L2-normalised by the caller, `q` scaled by `scale` and the state
`S` of shape [K, V]:

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,      o_t = S_t^T q_t

`g` is the log-decay; its shape is the gate kind (`gate_kind`): `None` ("none": DeltaNet, no decay), one value
per head ("scalar": Gated DeltaNet) or one value per key channel ("channel": KDA, "Kimi delta attention").

Shapes (fla's layout):
    q, k:  [B, T, H, K]
    v:     [B, T, H, V]
    beta:  [B, T, H]
    g:     None, [B, T, H] or [B, T, H, K]
    state: [B, H, K, V], always float32
Every function returns `(o, final_state)` with `o` of shape [B, T, H, V] in `v`'s dtype.
State and accumulation are float32 whatever the input dtype.

GQA-shared state (`head_groups`): q may have H = G * Hkv heads while k, v, beta, g and the state have Hkv. Then one
state per KV head is written by that head's k, v, beta, g and read by its group of G queries: query head h reads
state h // G, and o is [B, T, H, V]. It is exactly the computation with k, v, beta, g repeated over each group
(`repeat_interleave(G, dim=2)`), whose G copies of a state stay equal; the kernels compute the shared terms once.

`delta_rule_reference` is the definition everything else is tested against (slow). `chunk_delta_rule_elementwise`
is the chunked form written plainly: a second reference, and the exact path `delta_rule.chunk_delta_rule` takes
for per-channel decays too steep for the fast kernel of `delta_chunk.py` (docs/design.md, "Chunked form").
"""

from __future__ import annotations

import torch


GATE_KINDS = ("none", "scalar", "channel")


def gate_kind(g: torch.Tensor | None) -> str:
    """The decay of a log-decay `g`: "none" (None), "scalar" ([B, T, H], one per head) or "channel" ([B, T, H, K]).

    Named as `DeltaConfig.linear_gate`. The entry points decide this once and pass it down."""
    if g is None:
        return "none"
    if g.dim() == 3:
        return "scalar"
    if g.dim() == 4:
        return "channel"
    raise ValueError(f"g must be None, [B, T, H] or [B, T, H, K], got shape {tuple(g.shape)}")


def head_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                g: torch.Tensor | None) -> int:
    """G, the query heads per KV head: q [B, T, G * Hkv, K] against k [B, T, Hkv, K], v [B, T, Hkv, V],
    beta [B, T, Hkv], g [B, T, Hkv(, K)]. 1 without GQA. Checks the shapes agree."""
    batch, seq_len, heads, key_dim = q.shape
    kv_heads = k.shape[2]
    if k.shape != (batch, seq_len, kv_heads, key_dim) or heads % kv_heads:
        raise ValueError(f"k must be [B, T, Hkv, K] with Hkv dividing q's heads: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    for name, x, dims in (("v", v, 4), ("beta", beta, 3), ("g", g, None)):
        if x is not None and (x.shape[:3] != (batch, seq_len, kv_heads) or (dims and x.dim() != dims)):
            raise ValueError(f"{name} must have k's [B, T, Hkv] = {(batch, seq_len, kv_heads)}, got {tuple(x.shape)}")
    return heads // kv_heads


def start_state(
    initial_state: torch.Tensor | None, batch: int, heads: int, key_dim: int, value_dim: int, device
) -> torch.Tensor:
    """The state entering the first token: `initial_state` (shape-checked) in float32, or zeros."""
    if initial_state is None:
        return torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=device)
    expected = (batch, heads, key_dim, value_dim)
    if tuple(initial_state.shape) != expected:
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {expected} (B, H, K, V)")
    return initial_state.float()


def expand_decay(decay: torch.Tensor, gate: str) -> torch.Tensor:
    """Shape a per-head [B, H] ("scalar") or per-channel [B, H, K] ("channel") decay to scale a [B, H, K, V]
    state."""
    return decay[..., None] if gate == "channel" else decay[..., None, None]


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                         g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule one token at a time, written as the definition reads. Slow; for tests.

    GQA (see the module docstring): q [B, T, G * Hkv, K], everything else per KV head; query head h reads state
    h // G."""
    gate = gate_kind(g)
    groups = head_groups(q, k, v, beta, g)
    batch, seq_len, heads, key_dim = k.shape  # heads: KV heads
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device).clone()
    outputs = []
    for t in range(seq_len):
        if g is not None:
            state = state * expand_decay(g[:, t].float().exp(), gate)
        k_t, v_t = k[:, t].float(), v[:, t].float()
        q_t = q[:, t].float().unflatten(1, (heads, groups)) * scale  # [B, Hkv, G, K]
        v_old = torch.einsum("bhkv,bhk->bhv", state, k_t)  # what the memory returns for k_t
        state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[:, t, :, None].float() * (v_t - v_old))
        outputs.append(torch.einsum("bhkv,bhgk->bhgv", state, q_t).flatten(1, 2))  # [B, H, V]
    if not outputs:
        return v.new_zeros(batch, 0, heads * groups, value_dim), state
    return torch.stack(outputs, dim=1).to(v.dtype), state


def _causal_mask(size: int, inclusive: bool, device) -> torch.Tensor:
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(0 if inclusive else -1)


def _decayed_scores(
    x: torch.Tensor, y: torch.Tensor, log_decay: torch.Tensor | None, gate: str, inclusive: bool, block: int = 16
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
    if gate == "scalar":
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


def chunk_delta_rule_elementwise(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                                 g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                                 scale: float | None = None, chunk_size: int = 64, gate: str | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunkwise form written plainly (float32, a loop over chunks, autograd through it); exact for any decay.

    `gate` is `gate_kind(g)` (computed when not given). Within a chunk of C tokens with cumulative log-decay G:
        T = (I + tril(diag(b) (K K^T . Gamma), -1))^{-1}     (one batched unit-triangular solve)
        U = T diag(b) V,    W = T diag(b) (K . exp(G))
    and across chunks, with S the state entering the chunk:
        V' = U - W S,   O = (Q . exp(G)) S + (Q K^T . Gamma . causal) V',
        S <- exp(G_C) S + (K . exp(G_C - G))^T V'
    """
    gate = gate_kind(g) if gate is None else gate
    groups = head_groups(q, k, v, beta, g)
    batch, seq_len, heads, key_dim = k.shape  # heads: KV heads; q has heads * groups
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads * groups, value_dim), state

    chunk = chunk_size
    pad = (-seq_len) % chunk
    n_chunks = (seq_len + pad) // chunk

    def to_chunks(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, ...] -> [B, H, N, C, ...], float32, zero-padded at the end (padded tokens leave S unchanged)
        x = x.float().movedim(2, 1)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(batch, x.shape[1], n_chunks, chunk, *x.shape[3:])

    # queries grouped by the KV head they read: [B, Hkv, G, N, C, K]; the key side has no group dimension
    q_c = to_chunks(q).unflatten(1, (heads, groups)) * scale
    k_c, v_c = to_chunks(k), to_chunks(v)  # [B, Hkv, N, C, K|V]
    beta_c = to_chunks(beta)  # [B, H, N, C]
    log_decay = to_chunks(g).cumsum(3) if g is not None else None  # [B, H, N, C] or [B, H, N, C, K]

    if log_decay is None:
        decay_in = decay_to_end = decay_chunk = None
        q_decayed, k_decayed, k_to_end = q_c, k_c, k_c
    else:
        channel = gate == "channel"
        last = log_decay[:, :, :, -1:]  # [B, H, N, 1(, K)]
        decay_in = log_decay.exp() if channel else log_decay.exp()[..., None]
        decay_to_end = (last - log_decay).exp() if channel else (last - log_decay).exp()[..., None]
        decay_chunk = last.squeeze(3).exp()  # [B, H, N(, K)]
        q_decayed, k_decayed, k_to_end = q_c * decay_in[:, :, None], k_c * decay_in, k_c * decay_to_end

    # UT transform: (I + strict_tril(diag(b) K K^T . Gamma)) [U | W] = diag(b) [V | K . exp(G)]
    kk = _decayed_scores(k_c, k_c, log_decay, gate, inclusive=False) * beta_c[..., None]
    rhs = beta_c[..., None] * torch.cat([v_c, k_decayed], dim=-1)
    solved = torch.linalg.solve_triangular(kk, rhs, upper=False, unitriangular=True)
    u, w = solved.split([value_dim, key_dim], dim=-1)
    q_log_decay = None if log_decay is None else log_decay[:, :, None]  # shared by the group
    qk = _decayed_scores(q_c, k_c[:, :, None], q_log_decay, gate, inclusive=True)  # [B, Hkv, G, N, C, C]

    outputs = []
    for n in range(n_chunks):
        v_new = u[:, :, n] - w[:, :, n] @ state  # [B, Hkv, C, V]
        shared = state[:, :, None]  # [B, Hkv, 1, K, V], read by the G queries of the group
        outputs.append(q_decayed[:, :, :, n] @ shared + qk[:, :, :, n] @ v_new[:, :, None])  # [B, Hkv, G, C, V]
        if decay_chunk is not None:
            state = state * expand_decay(decay_chunk[:, :, n], gate)
        state = state + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=3).reshape(batch, heads * groups, n_chunks * chunk, value_dim)[:, :, :seq_len]
    return o.movedim(1, 2).to(v.dtype), state
