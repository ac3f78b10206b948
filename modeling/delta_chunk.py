"""Fast chunkwise delta rule for CPUs: batched matmuls over (batch, head, chunk) and a chunked backward.

The maths is the WY / UT form of docs/design.md, "Chunked form". Per chunk of C tokens, with `G` the chunk-local
cumulative log-decay (per head or per key channel), `S` the state entering the chunk and `b` the betas:

    M  = tril(Q K^T . Gamma)                          (decayed causal scores, Gamma = exp(G_t - G_i))
    A  = strict_tril(diag(b) K K^T . Gamma),    T = (I + A)^-1
    U  = T diag(b) V,                           W = T diag(b) (K . exp(G))
    V' = U - W S,                               O = (Q . exp(G)) S + M V'
    S_next = exp(G_C) S + (K . exp(G_C - G))^T V'

Everything except V' and S_next is one batched matmul (or elementwise op) over all chunks at once; the loop over
chunks does two small matmuls per chunk. The backward recomputes the intra-chunk terms, runs the state gradient
through the chunks in reverse (the same two matmuls) and is otherwise batched too. It saves only the chunked
inputs, the state entering each chunk and V'.

Tensors live in a chunk-major layout [N, B, H, C, D]. q and k share one buffer [N, B, H, G + 1, C, K] so that all
score matrices come out of one matmul: [..., :G] are the queries, [..., G] (the last) the key. G is 1 without GQA;
with a GQA-shared state (q with G times as many heads as k) H counts KV heads and the G query heads reading a KV
head's state are stacked next to its key: every key-side term (the UT transform, V', the states) is computed once per
KV head, the query-side ones (scores, outputs) once per query head, with the group folded into the rows of the
batched matmuls ([G * C, K] query blocks).
With bf16 inputs the matmuls run in bf16 where the device multiplies bf16 natively (a GPU, or a CPU with AMX or
AVX512-BF16; see `bf16_matmuls`), while decays, the triangular inverse and the state stay float32; elsewhere the
kernel computes in float32 and returns bf16.
"""

from __future__ import annotations

import functools
import logging

import torch

from .delta_reference import gate_kind


logger = logging.getLogger(__name__)

# Per-channel gate: scores are factorised through a reference log-decay at the start of each sub-block of
# `SUB_BLOCK` tokens. Inside a sub-block one factor is exp(+decay over at most SUB_BLOCK tokens); when that
# exceeds exp(LOG_SPAN_LIMIT) (not reachable with ordinary gates: it needs a per-token decay below e^-3.7 on
# every token of the sub-block) the caller falls back to the exact elementwise path.
SUB_BLOCK = 16
LOG_SPAN_LIMIT = 60.0
# A per-token log-decay floor (the config's `linear_log_decay_floor`) that keeps every sub-block within the limit:
# SUB_BLOCK * -3.5 = -56 >= -LOG_SPAN_LIMIT. Trained channel gates do go beyond it unbounded (per-token log-decays
# of -10 to -28 in some channels of every layer after 500k tokens of distillation), and the exact elementwise path
# then made distillation 4x slower with 1.7x the memory.
FAST_LOG_DECAY_FLOOR = -3.5
# chunk matrices (chunks x batch x heads) per segment of the forward and the backward (see `_segments`):
# 144 (16 chunks of 9 heads) measured best here; all chunks at once made forward+backward at T = 8192 (B=1, H=9,
# one thread) 15-35% slower (bf16 438 vs 318 ms), 72 per segment was no better than 144.
SEGMENT_MATRICES = 144


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + strict_tril(a))^-1 for a batch of [C, C] matrices, float32. Only the strict lower triangle of `a` is read.

    One batched LAPACK triangular solve against the identity, with `a` passed as it is: `unitriangular=True` takes
    the diagonal as ones and `upper=False` never reads above it. Measured (one thread, 144 matrices of 64 x 64):
    1.4 ms, vs 2.3 ms for the blockwise doubling formerly used here (T21 = -T22 A21 T11 over blocks of 1, 2, ...,
    C/2: many small strided ops) and 4.4 ms for the same solve on a separately built `tril(a, -1) + I`.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)


@functools.lru_cache(maxsize=None)
def causal_mask(size: int, diagonal: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tril(ones(size, size), diagonal)` of `dtype` on `device`, built once per argument tuple and shared: callers
    must not write into it. Masking by multiplying with a float mask measured 5-7x faster than `masked_fill_` on a
    strided [chunks, 64, 64] view (0.13 vs 0.72 ms for 144 matrices)."""
    with torch.inference_mode(False):  # a normal tensor, usable by autograd outside inference mode too
        return torch.ones(size, size, dtype=dtype, device=device).tril_(diagonal)


# ----------------------------------------------------------------------------------------------------------
# layout


def _write(destination: torch.Tensor, source: torch.Tensor, scale: float | None) -> None:
    """destination <- source (times `scale`), casting to destination's dtype: one pass."""
    if scale is None:
        destination.copy_(source)
    else:
        torch.mul(source, scale, out=destination)


def to_chunks(x: torch.Tensor, chunk: int, dtype: torch.dtype, out: torch.Tensor | None = None,
              scale: float | None = None) -> torch.Tensor:
    """[B, T, H, ...] -> [N, B, H, C, ...] in `dtype` (times `scale`), zero-padded at the end: one pass (layout, cast
    and scale).

    Chunk-major, so that the one chunk the sequential loop works on is a contiguous [B*H, C, ...] block."""
    batch, seq_len, heads = x.shape[:3]
    n_chunks = -(-seq_len // chunk)
    if out is None:
        out = x.new_empty((n_chunks, batch, heads, chunk, *x.shape[3:]), dtype=dtype)
    full, rest = divmod(seq_len, chunk)
    if full:  # [B, full * C, H, ...] -> [full, B, H, C, ...]
        source = x[:, : full * chunk].unflatten(1, (full, chunk)).permute(1, 0, 3, 2, *range(4, x.dim() + 1))
        _write(out[:full], source, scale)
    if rest:
        _write(out[full, :, :, :rest], x[:, full * chunk :].movedim(2, 1), scale)
        out[full, :, :, rest:].zero_()
    return out


def write_from_chunks(out: torch.Tensor, x: torch.Tensor, first_token: int = 0, scale: float | None = None):
    """Writes chunks `x` [n, B, H, C, ...] into `out` [B, T, H, ...] from token `first_token` on (times `scale`),
    dropping what lies past T (the zero padding): one pass, through views of `out` (a reshape of the permuted chunks
    would copy them once more first)."""
    chunk = x.shape[3]
    out = out[:, first_token : first_token + x.shape[0] * chunk]
    full, rest = divmod(out.shape[1], chunk)
    if full:  # [full, B, H, C, ...] -> [B, full * C, H, ...]
        source = x[:full].permute(1, 0, 3, 2, *range(4, x.dim()))
        _write(out[:, : full * chunk].unflatten(1, (full, chunk)), source, scale)
    if rest:
        _write(out[:, full * chunk :], x[full, :, :, :rest].movedim(2, 1), scale)


def from_chunks(x: torch.Tensor, seq_len: int, dtype: torch.dtype, scale: float | None = None) -> torch.Tensor:
    """[N, B, H, C, ...] -> [B, T, H, ...] in `dtype` (times `scale`): one pass."""
    batch, heads = x.shape[1:3]
    out = torch.empty(batch, seq_len, heads, *x.shape[4:], dtype=dtype, device=x.device)
    write_from_chunks(out, x, scale=scale)
    return out


# ----------------------------------------------------------------------------------------------------------
# decayed causal scores: score[t, i] = sum_d x_t[d] k_i[d] exp(G_t[d] - G_i[d]) for i <= t, x in (q, k)


def _per_token(x: torch.Tensor, channel: bool) -> torch.Tensor:
    """A per-head decay [..., C] broadcast against [..., C, K]; a per-channel one [..., C, K] as it is."""
    return x if channel else x[..., None]


def _to_decay_shape(x: torch.Tensor, channel: bool) -> torch.Tensor:
    """A [..., C, K] gradient reduced to the decay's shape: summed over K for a per-head decay."""
    return x if channel else x.sum(-1)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`. Elementwise ops always get operands of one dtype: on this CPU a bf16 x float32 product
    with broadcasting takes a slow path, 3.6 ms instead of 0.17 ms for 1.2M elements (measured)."""
    return x if x.dtype == dtype else x.to(dtype)


class _Scores:
    """The two score matrices of a chunk, Q K^T . Gamma and K K^T . Gamma, in one of three exact forms.

    * "factored": no decay, or no chunk decays by more than exp(-LOG_SPAN_LIMIT) in any channel. Then
      exp(G_t - G_i) = exp(G_t) exp(-G_i) with both factors in float range: scores = [Q; K] . exp(G) times
      (K . exp(-G))^T, one matmul whose left operand is needed anyway (Q . exp(G) and K . exp(G)).
    * "gamma": per-head decay of any strength: (x k^T) . Gamma with Gamma = exp(G_t - G_i) on and below the
      diagonal, no exponent ever > 0.
    * "blocks": per-channel decay where no sub-block of SUB_BLOCK tokens decays by more than
      exp(-LOG_SPAN_LIMIT): factored through the log-decay at the start of each row's sub-block.
    (A per-channel decay beyond that takes the exact elementwise path of `delta_reference.py`.)

    `qk` is [..., G + 1, C, K]: G query blocks, then the key. `forward()` gives [..., G + 1, C, C]: [:-1] = Q K^T .
    Gamma per query block, masked to i <= t, [-1] = K K^T . Gamma with only its strict lower triangle meaningful
    (the rest is finite garbage that the callers never read).
    """

    def __init__(self, qk, qk_decayed, log_decay, decay, channel: bool):
        self.qk, self.qk_decayed, self.channel = qk, qk_decayed, channel
        self.chunk = qk.shape[-2]
        self.k = qk[..., -1, :, :]
        if log_decay is None:
            self.mode, self.right = "factored", self.k
            return
        last = log_decay[..., -1:, :] if channel else log_decay[..., -1:]
        if bool((last.amin() >= -LOG_SPAN_LIMIT).item()):
            self.mode = "factored"
            self.inverse_decay = (-log_decay).exp_()
            self.right = torch.empty_like(self.k)
            torch.mul(self.k, _as(_per_token(self.inverse_decay, channel), qk.dtype), out=self.right)  # K.exp(-G)
        elif not channel:
            self.mode = "gamma"
            gamma = log_decay[..., :, None] - log_decay[..., None, :]
            above = ~causal_mask(self.chunk, 0, qk.device, torch.bool)
            self.gamma = gamma.masked_fill_(above, float("-inf")).exp_()  # [..., C, C]
        else:
            self.mode = "blocks"
            self.sub = SUB_BLOCK if self.chunk % SUB_BLOCK == 0 else self.chunk
            # reference log-decay at the start of each sub-block (0 at the chunk start): [..., n_sub, K]
            previous = torch.nn.functional.pad(log_decay[..., :-1, :], (0, 0, 1, 0))
            reference = previous[..., :: self.sub, :]
            # left factor exp(G_t - ref) <= 1, right factor exp(ref - G_i), clamped where it is masked anyway
            self.left = (log_decay - reference.repeat_interleave(self.sub, dim=-2)).exp_()  # [..., C, K]
            right = (reference[..., :, None, :] - log_decay[..., None, :, :]).clamp_max_(LOG_SPAN_LIMIT).exp_()
            self.right_scale = right  # [..., n_sub, C, K]
            # x = [q; k] . exp(G_t - ref), laid out by sub-block with the G + 1 row blocks of each side by side,
            # [..., n_sub, (G + 1) sub, K], so that each sub-block's products are one matmul over all its rows (a
            # [..., G + 1, n_sub, sub, K] layout needs y broadcast to every row block: a copy G + 1 times y's size)
            n_sub, groups = self.chunk // self.sub, qk.shape[-3]
            x = qk.new_empty(*qk.shape[:-3], n_sub, groups, self.sub, qk.shape[-1])
            left = _as(self.left, qk.dtype).unflatten(-2, (n_sub, self.sub))  # [..., n_sub, sub, K]
            torch.mul(self._by_sub_block(qk), left[..., None, :, :], out=x)
            self.x = x.flatten(-3, -2)  # [..., n_sub, (G + 1) sub, K]
            self.y = self.k[..., None, :, :] * _as(right, qk.dtype)  # [..., n_sub, C, K]

    def _by_sub_block(self, x: torch.Tensor) -> torch.Tensor:
        # [..., G + 1, C, *] -> a view [..., n_sub, G + 1, sub, *] (sub-block first)
        return x.unflatten(-2, (self.chunk // self.sub, self.sub)).transpose(-4, -3)

    def _by_row_block(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        # [..., n_sub, (G + 1) sub, *] -> a view [..., G + 1, n_sub, sub, *] (row block first)
        return x.unflatten(-2, (groups, self.sub)).transpose(-4, -3)

    def forward(self) -> torch.Tensor:
        """[..., G + 1, C, C] in the matmul dtype (float32 for "gamma"), M masked (see the class docstring)."""
        if self.mode == "factored":
            scores = self.qk_decayed.flatten(-3, -2) @ self.right.mT  # [..., (G + 1) C, C]
            scores = scores.unflatten(-2, (-1, self.chunk))
        elif self.mode == "gamma":
            scores = (self.qk.flatten(-3, -2) @ self.k.mT).unflatten(-2, (-1, self.chunk))  # [..., G + 1, C, C]
            scores = _as(scores, torch.float32).mul_(self.gamma[..., None, :, :])
        else:
            groups = self.qk.shape[-3]
            scores = self._by_row_block(self.x @ self.y.mT, groups).flatten(-3, -2)  # [..., G + 1, C, C] (a copy)
        if self.mode != "gamma":  # Gamma is already 0 above the diagonal
            scores[..., :-1, :, :].mul_(causal_mask(self.chunk, 0, scores.device, scores.dtype))
        return scores

    def backward(self, grad: torch.Tensor, gated: torch.Tensor):
        """Gradients of `sum(grad * scores)` for a masked float32 `grad` [..., G + 1, C, C]; `gated` is `forward()`.

        Returns (d_qk, d_qk_decayed, d_k, d_log), float32 or None where there is none: the gradients with respect
        to the raw [q; k] and to [Q; K] . exp(G) ([..., G + 1, C, K]), to the raw k alone ([..., C, K]) and to the
        log-decay.
        """
        mm = self.qk.dtype
        if self.mode == "factored":
            flat = grad.to(mm).flatten(-3, -2)  # [..., (G + 1) C, C]
            d_left = (flat @ self.right).float().unflatten(-2, (-1, self.chunk))  # [..., G + 1, C, K]
            d_right = (flat.mT @ self.qk_decayed.flatten(-3, -2)).float()  # [..., C, K]
            if self.right is self.k:  # no decay: left and right are the raw q and k
                return None, d_left, d_right, None
            d_log = -_to_decay_shape(d_right * _as(self.right, torch.float32), self.channel)
            d_right *= _per_token(self.inverse_decay, self.channel)
            return None, d_left, d_right, d_log
        if self.mode == "gamma":
            weighted = (grad * self.gamma[..., None, :, :]).to(mm)  # [..., G + 1, C, C]
            flat = weighted.flatten(-3, -2)  # [..., (G + 1) C, C]
            d_qk = (flat @ self.k).float().unflatten(-2, (-1, self.chunk))  # [..., G + 1, C, K]
            d_qk[..., -1, :, :] += _as(flat.mT @ self.qk.flatten(-3, -2), torch.float32)
            contribution = (grad * gated).sum(-3)  # [..., C, C]
            return d_qk, None, None, contribution.sum(-1) - contribution.sum(-2)
        n_sub, sub, groups = self.chunk // self.sub, self.sub, grad.shape[-3]
        grad_mm = grad.new_empty(*grad.shape[:-3], n_sub, groups, sub, grad.shape[-1], dtype=mm)
        grad_mm = grad_mm.copy_(self._by_sub_block(grad)).flatten(-3, -2)  # [..., n_sub, (G + 1) sub, C]
        hx = (grad_mm @ self.y).float()  # [..., n_sub, (G + 1) sub, K]
        d_qk = grad.new_empty(*grad.shape[:-3], groups, n_sub, sub, hx.shape[-1])
        torch.mul(self._by_row_block(hx, groups), self.left.unflatten(-2, (n_sub, sub))[..., None, :, :, :], out=d_qk)
        d_qk = d_qk.flatten(-3, -2)  # [..., G + 1, C, K]
        hy = (grad_mm.mT @ self.x).float()  # [..., n_sub, C, K]: over the sub-block's q rows and k rows at once
        d_right = (hy * self.right_scale).sum(-3)  # [..., C, K]
        d_log = (self.qk.float() * d_qk).sum(-3) - self.k.float() * d_right
        return d_qk, None, d_right, d_log


# ----------------------------------------------------------------------------------------------------------
# intra-chunk terms


class _ChunkTerms:
    """What a chunk needs that does not depend on the state entering it: decays, scores and the UT transform."""

    def __init__(self, qk, v, beta, log_decay, channel: bool, for_backward: bool = False):
        mm = qk.dtype
        self.channel, self.log_decay = channel, log_decay
        k = qk[..., -1, :, :]

        if log_decay is None:
            self.decay = self.decay_to_end = self.decay_chunk = None
            self.qk_decayed, self.k_to_end = qk, k
        else:
            last = log_decay[..., -1:, :] if channel else log_decay[..., -1:]
            self.decay = log_decay.exp()  # exp(G): [..., C(, K)]
            self.decay_to_end = (last - log_decay).exp_()  # exp(G_C - G)
            self.decay_chunk = last.squeeze(-2 if channel else -1).exp()  # exp(G_C): [...(, K)]
            self.qk_decayed = qk * _as(_per_token(self.decay, channel), mm)[..., None, :, :]  # [Q; K] . exp(G)
            self.k_to_end = k * _as(_per_token(self.decay_to_end, channel), mm)  # K . exp(G_C - G)

        self.scores = _Scores(qk, self.qk_decayed, log_decay, self.decay, channel)
        gated = self.scores.forward()  # [..., G + 1, C, C]: M per query block, then K K^T . Gamma
        kk = _as(gated[..., -1, :, :], torch.float32)  # K K^T . Gamma, float32: [..., C, C]
        a = kk * beta[..., :, None]
        self.m = gated[..., :-1, :, :].to(mm)  # [..., G, C, C]
        self.inverse = unit_lower_inverse(a)  # float32 [..., C, C]
        if for_backward:  # (the "gamma" form, the only one whose backward reads the scores, has them in float32)
            self.gated, self.kk = gated, kk

        # U = T diag(b) V and W = T diag(b) (K . exp(G)): beta scales T's columns (one [C, C] pass) instead of the
        # right-hand sides, and two [C, C] x [C, 64] matmuls (contiguous U and W) beat one [C, C] x [C, 128]
        inverse_beta = _as(self.inverse * beta[..., None, :], mm)  # [..., C, C]
        self.u = inverse_beta @ v  # [..., C, V]
        self.w = inverse_beta @ self.qk_decayed[..., -1, :, :]  # [..., C, K]
        if for_backward:
            self.inverse_mm = _as(self.inverse, mm)

    @staticmethod
    def flat(x: torch.Tensor) -> torch.Tensor:
        """[N, B, H, ...] -> [N, B*H, ...]"""
        return x.flatten(1, 2)

    def chunk_decay(self) -> torch.Tensor | None:
        """exp(G_C) shaped to scale [N, BH, K, V] states: [N, BH, K, 1] (per channel) or [N, BH, 1, 1]."""
        if self.decay_chunk is None:
            return None
        decay = self.flat(self.decay_chunk)
        return decay[..., None] if self.channel else decay[..., None, None]


def _scan_forward(terms: _ChunkTerms, states: torch.Tensor, v_new: torch.Tensor,
                  states_mm: torch.Tensor | None = None) -> None:
    """The sequential part: per chunk V' = U - W S, then S <- exp(G_C) S + Ke^T V'.

    Fills `states` [N + 1, BH, K, V] (float32; [0], the state entering the first chunk, is given) and `v_new`
    [N, BH, C, V] (matmul dtype). With bf16 inputs the two matmuls run in bf16 and their products are added to the
    float32 state; `states_mm` [N, BH, K, V] (bf16) then receives the bf16 copy of the state entering each chunk
    that the first matmul needs, for the caller's output matmul to reuse. (A variant that precomputes
    P = Diag(exp(G_C)) - Ke^T W and R = Ke^T U, leaving one matmul per chunk, measured 15-30% slower in float32 and
    no faster in bf16: it costs two more batched matmuls, M W and Ke^T W, than the sequential matmul it saves.)
    """
    mm = terms.u.dtype
    w = terms.flat(terms.w)  # [N, BH, C, K]
    k_to_end = terms.flat(terms.k_to_end)  # [N, BH, C, K]
    decay = terms.chunk_decay()
    v_new.copy_(terms.flat(terms.u))  # one batched copy; each step then subtracts W S in place
    for n in range(w.shape[0]):
        state = states[n] if states_mm is None else states_mm[n].copy_(states[n])
        v_new[n].baddbmm_(w[n], state, alpha=-1)
        if decay is None:
            states[n + 1] = states[n]
        else:
            torch.mul(states[n], decay[n], out=states[n + 1])
        if mm == torch.float32:
            states[n + 1].baddbmm_(k_to_end[n].mT, v_new[n])
        else:
            states[n + 1].add_(torch.bmm(k_to_end[n].mT, v_new[n]))  # bf16 product added to the float32 state


def _segments(n_chunks: int, flat_heads: int):
    """Consecutive ranges of chunks to process at once. All chunks at once would be fewest ops, but long inputs
    then stream every intermediate through memory several times; segments of about SEGMENT_MATRICES chunk
    matrices (chunks x batch x heads) stay in cache and bound the backward's memory."""
    step = max(1, SEGMENT_MATRICES // flat_heads)
    return [(start, min(start + step, n_chunks)) for start in range(0, n_chunks, step)]


def chunk_forward(qk, v, beta, log_decay, state, channel: bool):
    """Chunked delta rule on prepared chunks.

    qk: [N, B, H, G + 1, C, K] (G query blocks, then the key; q unscaled); v: [N, B, H, C, V]; beta: [N, B, H, C]
    float32; log_decay: None | [N, B, H, C] | [N, B, H, C, K] chunk-local cumsum, float32 (`channel`: the last one);
    state: [B, H, K, V] float32. H counts KV heads (one state each).
    Returns (o [N, B, H, G, C, V] unscaled, states [N + 1, BH, K, V], V' [N, BH, C, V]); states[-1] is the final one.
    """
    n_chunks, batch, heads, stacked, chunk, key_dim = qk.shape
    value_dim, mm, flat_heads, groups = v.shape[-1], qk.dtype, batch * heads, stacked - 1
    out = torch.empty(n_chunks, batch, heads, groups, chunk, value_dim, dtype=mm, device=qk.device)
    states = torch.empty(n_chunks + 1, flat_heads, key_dim, value_dim, dtype=torch.float32, device=qk.device)
    states[0] = state.reshape(flat_heads, key_dim, value_dim)
    v_new = torch.empty(n_chunks, flat_heads, chunk, value_dim, dtype=mm, device=qk.device)
    for start, end in _segments(n_chunks, flat_heads):
        segment = slice(start, end)
        terms = _ChunkTerms(qk[segment], v[segment], beta[segment], _part(log_decay, segment), channel)
        states_mm = None if mm == torch.float32 else states.new_empty((end - start, *states.shape[1:]), dtype=mm)
        _scan_forward(terms, states[start : end + 1], v_new[segment], states_mm)
        entering = states[start:end] if states_mm is None else states_mm  # [n, BH, K, V] in the matmul dtype
        # O = Q . exp(G) S + M V', batched over the segment's chunks, the group folded into the rows: [G C, ...]
        q_decayed = terms.qk_decayed[..., :-1, :, :].reshape(-1, groups * chunk, key_dim)
        out_flat = out[segment].view(-1, groups * chunk, value_dim)
        torch.bmm(q_decayed, entering.view(-1, key_dim, value_dim), out=out_flat)
        out_flat.baddbmm_(terms.m.reshape(-1, groups * chunk, chunk), v_new[segment].view(-1, chunk, value_dim))
    return out, states, v_new


def _part(x: torch.Tensor | None, segment: slice) -> torch.Tensor | None:
    return None if x is None else x[segment]


def _scan_backward(terms: _ChunkTerms, grad_out: torch.Tensor, grad_final: torch.Tensor | None):
    """The sequential part of the backward, in reverse: dV' = M^T dO + Ke dS_out and
    dS_in = (Q . exp(G))^T dO + exp(G_C) dS_out - W^T dV'.

    Returns the state gradients [N + 1, BH, K, V] (float32; [n] is the one entering chunk n, [0] the initial
    state's) and dV' [N, BH, C, V] (matmul dtype)."""
    mm = grad_out.dtype
    w = terms.flat(terms.w)  # [N, BH, C, K]
    n_chunks, flat_heads, _, key_dim = w.shape
    value_dim = grad_out.shape[-1]
    k_to_end = terms.flat(terms.k_to_end)
    decay = terms.chunk_decay()
    # the parts that do not depend on the state gradient, batched over all chunks (and summed over the G query
    # blocks reading the state: the group folded into the contracted rows), written where the loop then accumulates
    # in place: dV' starts as M^T dO, dS_in as (Q . exp(G))^T dO
    grad_rows = grad_out.flatten(-3, -2)  # [N, B, H, G C, V]
    grad_v_new = terms.flat(terms.m.flatten(-3, -2).mT @ grad_rows)  # [N, BH, C, V], matmul dtype
    grads = torch.empty(n_chunks + 1, flat_heads, key_dim, value_dim, dtype=torch.float32, device=w.device)
    q_rows = terms.qk_decayed[..., :-1, :, :].flatten(-3, -2).mT  # [N, B, H, K, G C]
    if mm == torch.float32:
        torch.matmul(q_rows, grad_rows, out=grads[:-1].view(grad_rows.shape[:3] + (key_dim, value_dim)))
    else:
        grads[:-1] = terms.flat(q_rows @ grad_rows)
    if grad_final is None:
        grads[-1].zero_()
    else:
        grads[-1] = grad_final.reshape(flat_heads, key_dim, value_dim)
    for n in range(n_chunks - 1, -1, -1):
        grad_v_new[n].baddbmm_(k_to_end[n], grads[n + 1].to(mm))
        if mm == torch.float32:
            grads[n].baddbmm_(w[n].mT, grad_v_new[n], alpha=-1)
        else:
            grads[n].sub_(torch.bmm(w[n].mT, grad_v_new[n]))
        if decay is None:
            grads[n] += grads[n + 1]
        else:
            grads[n].addcmul_(grads[n + 1], decay[n])
    return grads, grad_v_new


def chunk_backward(qk, v, beta, log_decay, states, v_new, grad_out, grad_final, channel: bool, grads_out):
    """Gradients of the chunked delta rule. `grad_out` [N, B, H, G, C, V] is for the unscaled output; `states` and
    `v_new` are what `chunk_forward` returned. Segments run last to first, the state gradient carried between them.

    `grads_out` = (dq [B, T, H * G, K], dk [B, T, H, K], dv [B, T, H, V], dbeta [B, T, H], dg (None or g's shape)):
    each segment writes its part straight into these (no chunked copy of the whole gradient), dg already as the
    per-token gradient (the reverse cumulative sum within each chunk done per segment). Returns dstate.
    """
    n_chunks, batch, heads, stacked, chunk = qk.shape[:5]
    grad_q, grad_k, grad_v, grad_beta, grad_g = grads_out
    grad_q = grad_q.unflatten(2, (heads, stacked - 1))  # [B, T, H, G, K]: query head h = G * kv + j
    carried = grad_final
    for start, end in reversed(_segments(n_chunks, batch * heads)):
        segment = slice(start, end)
        parts = _segment_backward(
            qk[segment], v[segment], beta[segment], _part(log_decay, segment), states[start : end + 1],
            v_new[segment], grad_out[segment], carried, channel,
        )
        first_token = start * chunk
        grad_qk = parts[0]  # [n, B, H, G + 1, C, K] -> the G query blocks as [n, B, H, C, G, K]
        write_from_chunks(grad_q, grad_qk[:, :, :, :-1].movedim(3, 4), first_token)
        write_from_chunks(grad_k, grad_qk[:, :, :, -1], first_token)
        write_from_chunks(grad_v, parts[1], first_token)
        write_from_chunks(grad_beta, parts[2], first_token)
        if grad_g is not None:  # dg_t = sum_{s >= t} dG_s within the chunk
            write_from_chunks(grad_g, parts[3].flip(3).cumsum(3).flip(3), first_token)
        carried = parts[4]
    return carried


def _segment_backward(qk, v, beta, log_decay, states, v_new, grad_out, grad_final, channel: bool):
    """`chunk_backward` for consecutive chunks; `states` [N + 1, BH, K, V] from the one entering the first chunk to
    the one leaving the last, `grad_final` the gradient there. Returns the same five gradients."""
    mm = qk.dtype
    n_chunks, batch, heads, _, chunk, key_dim = qk.shape
    value_dim = v.shape[-1]
    chunked = (n_chunks, batch, heads)  # grad_out: [*chunked, G, C, V]
    terms = _ChunkTerms(qk, v, beta, log_decay, channel, for_backward=True)
    grad_out = grad_out.to(mm)
    grads, grad_v_new = _scan_backward(terms, grad_out, grad_final)
    grad_state = grads[0].view(batch, heads, key_dim, value_dim)

    states_in = states[:-1].view(*chunked, key_dim, value_dim)  # entering each chunk
    grads_out = grads[1:].view(*chunked, key_dim, value_dim)  # at each chunk's end
    states_mm, grads_out_mm = states_in.to(mm), grads_out.to(mm)
    grad_v_new, v_new = grad_v_new.view(*chunked, chunk, value_dim), v_new.view(*chunked, chunk, value_dim)
    grad_k_to_end = _as(v_new @ grads_out_mm.mT, torch.float32)  # [..., C, K]
    # through U = T diag(b) V and W = T diag(b) (K . exp(G)): with dU = dV' and dW = -dV' S^T, the gradients of the
    # right-hand sides diag(b) V and diag(b) (K . exp(G)) are T^T dU and T^T dW = -rhs_k_neg, and
    # dA = -strict_tril(T^T dU U^T + T^T dW W^T): two matmuls each, no concatenated [C, V + K] buffers, and the
    # signs folded into the matmuls and the beta factors (no negation passes)
    inverse_t = terms.inverse_mm.mT
    rhs_v = inverse_t @ grad_v_new  # [..., C, V]
    rhs_k_neg = inverse_t @ (grad_v_new @ states_mm.mT)  # [..., C, K]
    grad_a = torch.baddbmm(  # rhs_k_neg W^T - rhs_v U^T, batched over the flattened chunks
        (rhs_k_neg @ terms.w.mT).flatten(0, -3), rhs_v.flatten(0, -3), terms.u.mT.flatten(0, -3), alpha=-1
    ).view(rhs_v.shape[:-1] + (chunk,))
    grad_a = _as(grad_a, torch.float32).tril_(-1)  # [..., C, C]
    rhs_v, rhs_k_neg = _as(rhs_v, torch.float32), _as(rhs_k_neg, torch.float32)

    qk_decayed = _as(terms.qk_decayed, torch.float32)
    kk = terms.kk
    grad_beta = (rhs_v * _as(v, torch.float32)).sum(-1) - (rhs_k_neg * qk_decayed[..., -1, :, :]).sum(-1)
    grad_beta += (grad_a * kk).sum(-1)
    grad_v = rhs_v * beta[..., None]

    grad_scores = torch.empty(*qk.shape[:-2], chunk, chunk, dtype=torch.float32, device=qk.device)  # [..., G+1, C, C]
    grad_m = grad_scores[..., :-1, :, :]  # dM per query block, written in place (float32) and masked by a multiply
    if mm == torch.float32:
        torch.matmul(grad_out, v_new.mT[..., None, :, :], out=grad_m)
    else:
        grad_m.copy_(grad_out @ v_new.mT[..., None, :, :])
    grad_m.mul_(causal_mask(chunk, 0, grad_m.device, grad_m.dtype))
    torch.mul(grad_a, beta[..., :, None], out=grad_scores[..., -1, :, :])  # d(K K^T . Gamma)
    grad_qk_raw, grad_qk_decayed, grad_k_raw, grad_log = terms.scores.backward(grad_scores, terms.gated)

    # gradients with respect to [Q; K] . exp(G): from the scores (the factored form's, whose buffer is reused), from
    # the output (every query block reads S) and from the right-hand side of the solve
    from_output = grad_out @ states_mm.mT[..., None, :, :]  # [..., G, C, K]
    neg_beta = -beta[..., None]
    if grad_qk_decayed is None:
        grad_qk_decayed = torch.empty(*qk.shape, dtype=torch.float32, device=qk.device)
        grad_qk_decayed[..., :-1, :, :] = from_output
        torch.mul(rhs_k_neg, neg_beta, out=grad_qk_decayed[..., -1, :, :])
    else:
        grad_qk_decayed[..., :-1, :, :] += from_output
        grad_qk_decayed[..., -1, :, :].addcmul_(rhs_k_neg, neg_beta)

    # chain [Q; K] . exp(G) and K . exp(G_C - G) back to the raw q and k (d/dG of [Q; K] . exp(G) first: the
    # chain rule then scales the buffer in place)
    if log_decay is None:
        grad_qk = grad_qk_decayed
    else:
        from_decayed = _to_decay_shape((grad_qk_decayed * qk_decayed).sum(-3), channel)
        grad_qk = grad_qk_decayed.mul_(_per_token(terms.decay, channel)[..., None, :, :])
    if grad_qk_raw is not None:
        grad_qk += grad_qk_raw
    grad_k = grad_qk[..., -1, :, :]
    if grad_k_raw is not None:
        grad_k += grad_k_raw
    if log_decay is None:
        grad_k += grad_k_to_end
        return grad_qk, grad_v, grad_beta, None, grad_state
    grad_k.addcmul_(grad_k_to_end, _per_token(terms.decay_to_end, channel))
    # d/dG of K . exp(G_C - G); exp(G_C) also multiplies the state entering the chunk
    to_end = _to_decay_shape(grad_k_to_end * _as(terms.k_to_end, torch.float32), channel)  # [..., C(, K)]
    grad_log = from_decayed - to_end if grad_log is None else grad_log + from_decayed - to_end
    grad_decay_chunk = (states_in * grads_out).sum(-1)  # [..., K]
    if not channel:
        grad_decay_chunk = grad_decay_chunk.sum(-1)
    last = grad_log[..., -1:, :] if channel else grad_log[..., -1:]
    last += (to_end.sum(-2 if channel else -1) + grad_decay_chunk * terms.decay_chunk).unsqueeze(-2 if channel else -1)
    return grad_qk, grad_v, grad_beta, grad_log, grad_state


# ----------------------------------------------------------------------------------------------------------
# entry point


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16). True where torch cannot tell (the
    checks are private helpers of `torch.cpu`), which keeps bf16 matmuls as before."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    checks = [check for check in checks if check is not None]
    return not checks or any(check() for check in checks)


@functools.cache
def _cpu_has_native_bf16() -> bool:
    """`cpu_has_native_bf16`, asked once per process; logs what its answer means for the kernel."""
    native = cpu_has_native_bf16()
    if not native:
        logger.info("delta rule: this CPU has no native bf16 matmuls (AMX, AVX512-BF16): bf16 inputs run the chunk "
                    "kernel in float32 and get bf16 outputs")
    return native


def bf16_matmuls(device: torch.device) -> bool:
    """Whether bf16 inputs keep the kernel's matmuls in bf16 on `device`: always off CPU, on CPU only with native
    bf16 support. Without it bf16 matmuls are emulated: 144 batched 64 x 64 products took 7.0 ms in bf16 against
    0.66 ms in float32 (one thread), and the bf16 kernel ran about 3-4x slower than the float32 one."""
    return device.type != "cpu" or _cpu_has_native_bf16()


def _prepare(q, k, v, beta, g, chunk):
    """Chunked, layout-converted inputs: qk [N, B, Hkv, G + 1, C, K] (the G query heads reading each KV head's
    state, then its key), v [N, B, Hkv, C, V] (in the matmul dtype), beta [N, B, Hkv, C] and the
    chunk-local cumulative log-decay, float32. G = 1 without GQA. bf16 inputs stay bf16 only where
    `bf16_matmuls(q.device)`."""
    mm = torch.bfloat16 if q.dtype == torch.bfloat16 and bf16_matmuls(q.device) else torch.float32
    batch, seq_len, heads, key_dim = k.shape
    groups = q.shape[2] // heads
    n_chunks = -(-seq_len // chunk)
    qk = q.new_empty((n_chunks, batch, heads, groups + 1, chunk, key_dim), dtype=mm)
    for j in range(groups):  # query heads j, G + j, 2G + j, ... read KV heads 0, 1, 2, ...
        to_chunks(q[:, :, j::groups], chunk, mm, out=qk[:, :, :, j])
    to_chunks(k, chunk, mm, out=qk[:, :, :, -1])
    v_c = to_chunks(v, chunk, mm)
    beta_c = to_chunks(beta, chunk, torch.float32)
    log_decay = None if g is None else to_chunks(g, chunk, torch.float32).cumsum_(3)
    return qk, v_c, beta_c, log_decay


class ChunkDeltaRuleFunction(torch.autograd.Function):
    """The chunked delta rule with a chunked backward; saves only the inputs and one state per chunk."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, initial_state, scale, chunk_size, channel):
        # the kernel chooses its own dtypes (`_prepare`); autocast (e.g. bf16 training) would change them under it
        with torch.autocast(q.device.type, enabled=False):
            return ChunkDeltaRuleFunction._forward(ctx, q, k, v, beta, g, initial_state, scale, chunk_size, channel)

    @staticmethod
    def _forward(ctx, q, k, v, beta, g, initial_state, scale, chunk_size, channel):
        batch, seq_len, heads, key_dim = k.shape  # heads: KV heads
        value_dim = v.shape[-1]
        qk, v_c, beta_c, log_decay = _prepare(q, k, v, beta, g, chunk_size)
        if initial_state is None:
            state = q.new_zeros((batch, heads, key_dim, value_dim), dtype=torch.float32)
        else:
            state = initial_state.float()
        o, states, v_new = chunk_forward(qk, v_c, beta_c, log_decay, state, channel)
        ctx.save_for_backward(qk, v_c, beta_c, log_decay, states, v_new)
        final = states[-1].clone().view(batch, heads, key_dim, value_dim)
        ctx.meta = (seq_len, scale, q.dtype, k.dtype, v.dtype, beta.dtype, None if g is None else g.dtype,
                    initial_state is not None, channel)
        return from_chunks(o.flatten(2, 3), seq_len, v.dtype, scale), final  # [N, B, Hkv G, C, V] -> [B, T, H, V]

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        with torch.autocast(grad_out.device.type, enabled=False):  # as in `forward` (backward may run under autocast)
            return ChunkDeltaRuleFunction._backward(ctx, grad_out, grad_final)

    @staticmethod
    def _backward(ctx, grad_out, grad_final):
        qk, v_c, beta_c, log_decay, states, v_new = ctx.saved_tensors
        seq_len, scale, q_dtype, k_dtype, v_dtype, beta_dtype, g_dtype, has_state, channel = ctx.meta
        batch, chunk, kv_heads, groups = qk.shape[1], qk.shape[-2], qk.shape[2], qk.shape[3] - 1
        key_dim, value_dim = qk.shape[-1], v_c.shape[-1]
        grad_out_c = to_chunks(grad_out, chunk, qk.dtype, scale=scale)  # [N, B, H, C, V]
        grad_out_c = grad_out_c.unflatten(2, (kv_heads, -1))  # [N, B, Hkv, G, C, V]
        device = qk.device
        grads = (
            torch.empty(batch, seq_len, kv_heads * groups, key_dim, dtype=q_dtype, device=device),
            torch.empty(batch, seq_len, kv_heads, key_dim, dtype=k_dtype, device=device),
            torch.empty(batch, seq_len, kv_heads, value_dim, dtype=v_dtype, device=device),
            torch.empty(batch, seq_len, kv_heads, dtype=beta_dtype, device=device),
            None if log_decay is None else torch.empty(batch, seq_len, *log_decay.shape[2:3], *log_decay.shape[4:],
                                                       dtype=g_dtype, device=device),
        )
        grad_state = chunk_backward(qk, v_c, beta_c, log_decay, states, v_new, grad_out_c, grad_final, channel, grads)
        return (*grads, grad_state if has_state else None, None, None, None)


def channel_decay_fits(g: torch.Tensor, chunk_size: int) -> bool:
    """Whether the factorised per-channel scores are exact for `g` [B, T, H, K]: no sub-block of `SUB_BLOCK`
    tokens (the sub-blocks of every chunk) decays by more than exp(-LOG_SPAN_LIMIT) in any channel."""
    sub = SUB_BLOCK if chunk_size % SUB_BLOCK == 0 else chunk_size
    seq_len = g.shape[1]
    pad = (-seq_len) % sub
    g = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, pad)) if pad else g
    spans = g.unflatten(1, (-1, sub)).sum(2, dtype=torch.float32)  # [B, T / sub, H, K], <= 0
    return bool((spans.amin() >= -LOG_SPAN_LIMIT).item()) if spans.numel() else True


def fast_chunk_delta_rule(q, k, v, beta, g=None, initial_state=None, scale=None, chunk_size=64, gate=None):
    """Chunked delta rule through `ChunkDeltaRuleFunction` (see `delta_rule.chunk_delta_rule` for the contract,
    GQA included: q may have G times as many heads as k); `gate` is `gate_kind(g)`, computed when not given."""
    gate = gate_kind(g) if gate is None else gate
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return ChunkDeltaRuleFunction.apply(q, k, v, beta, g, initial_state, scale, chunk_size, gate == "channel")
