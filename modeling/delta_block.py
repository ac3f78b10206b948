"""The delta rule over one short block in closed form: speculative verification and small prefill pieces.

A block of T new tokens (a few to a few dozen) leaves the state after it, and every token's output, as a small
triangular system (the WY / UT form the chunked kernel solves per chunk of 64, written for one block of exactly T
tokens: no padding, no chunk bookkeeping, no autograd function). With c_t the decay up to token t inside the block
(G_t = log c_t, the cumulative log-decay, per head or per key channel) and S_0 the state before the block:

    u_t = b_t (v_t - c_t k_t^T S_0 - sum_{s<t} (c_t / c_s) (k_t . k_s) u_s)   (one unit-lower triangular solve)
    o_t = c_t q_t^T S_0 + sum_{s<=t} (c_t / c_s) (q_t . k_s) u_s
    S_T = c_T S_0 + sum_s (c_T / c_s) k_s u_s^T

where (c_t / c_s) weights each key channel separately for a per-channel decay. Every ratio c_t / c_s with s <= t is
exp(G_t - G_s) <= 1. Per channel it is computed as c_t * (1 / c_s) (two matmuls) while the block's whole decay stays
within e^-60, where both factors are representable, and as the difference itself beyond that, so the form is exact
for any decay. It costs about fifteen batched ops whatever T is, where the per-token loop costs a few ops per token
(docs/design.md, "Fast inference path"). Shapes as `delta_reference.py`, GQA-shared state included.
"""

from __future__ import annotations

import torch

from .delta_reference import gate_kind, head_groups, start_state


#: a per-channel decay whose cumulative log stays within +-FACTORED_LOG_DECAY over the block takes the factored scores
#: (two matmuls); steeper ones take the ratios themselves ([B, H, T, T, K], slower, exact for any decay)
FACTORED_LOG_DECAY = 60.0


def _decays(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a block's log-decay [B, H, T] (per head) or [B, H, T, K] (per channel), float32: its cumulative sum G,
    the decay from the block's start to each token c = exp(G), and from each token to the block's end c_T / c_t
    (all the same shape)."""
    cumulative = log_decay.cumsum(2)  # G_t
    return cumulative, cumulative.exp(), (cumulative[:, :, -1:] - cumulative).exp()


def _decay_between(cumulative: torch.Tensor) -> torch.Tensor:
    """The decay between tokens c_t / c_s = exp(G_t - G_s), [B, H, T, T(, K)] from G [B, H, T(, K)], zero where
    s > t."""
    difference = cumulative.unsqueeze(3) - cumulative.unsqueeze(2)  # [t, s]: G_t - G_s
    seq_len = cumulative.shape[2]
    later = torch.ones(seq_len, seq_len, dtype=torch.bool, device=cumulative.device).triu(1)  # s > t
    if cumulative.dim() == 4:
        later = later[..., None]
    return difference.masked_fill(later, float("-inf")).exp()


def block_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over the T tokens of one block, solved at once (see the module docstring) -> (o, final state).

    Shapes as `recurrent_delta_rule`: q [B, T, G * Hkv, K], k [B, T, Hkv, K], v [B, T, Hkv, V], beta [B, T, Hkv],
    g None | [B, T, Hkv] | [B, T, Hkv, K], initial_state None | [B, Hkv, K, V]; o [B, T, G * Hkv, V] in v's dtype,
    the final state a new [B, Hkv, K, V] float32 tensor. Meant for short blocks (its T x T terms grow with T^2, and
    per-channel decays with T^2 K); differentiable, though the model only calls it without autograd.
    """
    gate = gate_kind(g)
    groups = head_groups(q, k, v, beta, g)
    batch, seq_len, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    scale = key_dim**-0.5 if scale is None else scale
    state = start_state(initial_state, batch, heads, key_dim, value_dim, q.device)  # [B, H, K, V]
    if seq_len == 0:
        return v.new_zeros(batch, 0, heads * groups, value_dim), state.clone()
    # per state head, tokens second-to-last: k [B, H, T, K], v [B, H, T, V], b [B, H, T, 1], q [B, H, G, T, K]
    key = k.float().transpose(1, 2)
    value = v.float().transpose(1, 2)
    b = beta.float().transpose(1, 2).unsqueeze(-1)
    query = (q.float() * scale).unflatten(2, (heads, groups)).permute(0, 2, 3, 1, 4)
    key_scores = key @ key.mT  # [B, H, T, T]: k_t . k_s
    query_scores = query @ key.mT.unsqueeze(2)  # [B, H, G, T, T]: q_t . k_s
    # the scores above the diagonal (s > t) are never read: `tril` selects below it for the solve and the output
    if gate == "none":
        key_from_start, key_to_end, query_from_start = key, key, query
    elif gate == "scalar":
        cumulative, from_start, to_end = _decays(g.float().transpose(1, 2))  # [B, H, T]
        between = _decay_between(cumulative)  # [B, H, T, T]
        key_scores = key_scores * between
        query_scores = query_scores * between.unsqueeze(2)
        key_from_start, key_to_end = key * from_start.unsqueeze(-1), key * to_end.unsqueeze(-1)
        query_from_start = query * from_start[:, :, None, :, None]
    else:  # per channel: the ratios weight each key channel, inside the dot products
        cumulative, from_start, to_end = _decays(g.float().transpose(1, 2))  # [B, H, T, K]
        if float(cumulative.detach().abs().max()) <= FACTORED_LOG_DECAY:
            # c_t / c_s = c_t * (1 / c_s), both factors within e^+-60: two matmuls, exact to float32 rounding (above
            # the diagonal the products are ratios above 1, up to inf, and never read)
            key_to_start = key * (-cumulative).exp()  # k_s / c_s, as exp(-G) so its gradient stays within e^60
            key_scores = (key * from_start) @ key_to_start.mT
            query_scores = (query * from_start.unsqueeze(2)) @ key_to_start.mT.unsqueeze(2)
        else:  # a steeper decay: the ratios themselves, [B, H, T, T, K]
            between = _decay_between(cumulative)
            key_scores = torch.einsum("bhtk,bhsk,bhtsk->bhts", key, key, between)
            query_scores = torch.einsum("bhgtk,bhsk,bhtsk->bhgts", query, key, between)
        key_scores = key_scores.tril()  # before `b *` below: an inf above the diagonal would make b's gradient NaN
        key_from_start, key_to_end = key * from_start, key * to_end
        query_from_start = query * from_start.unsqueeze(2)
    # (I + A) U = b (V - diag(c) K S_0), A strictly lower: A[t, s] = b_t (c_t / c_s) k_t . k_s
    lower = (b * key_scores).tril(-1)
    rhs = b * (value - key_from_start @ state)
    update = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # U [B, H, T, V]
    output = query_from_start @ state.unsqueeze(2) + query_scores.tril() @ update.unsqueeze(2)  # [B, H, G, T, V]
    if gate == "none":
        final = state + key_to_end.mT @ update
    elif gate == "scalar":
        final = state * from_start[:, :, -1, None, None] + key_to_end.mT @ update
    else:
        final = state * from_start[:, :, -1, :, None] + key_to_end.mT @ update
    output = output.permute(0, 3, 1, 2, 4).reshape(batch, seq_len, heads * groups, value_dim)
    return output.to(v.dtype), final


__all__ = ["block_delta_rule"]
