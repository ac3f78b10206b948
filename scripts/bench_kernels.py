"""Kernel benchmark: our chunked delta rule against transformers' own torch fallbacks, side by side.

Scalar gate: ours vs `torch_chunk_gated_delta_rule` (Qwen3-Next); channel gate: ours vs
`chunk_kimi_delta_attention` (KimiLinear). Forward and forward+backward, float32 and bf16 inputs, with the
achieved GFLOP/s against the machine's measured matmul peak of the same dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def timed(fn: Callable[[], object], min_repeats: int = 3, min_seconds: float = 1.0, max_repeats: int = 50,
          warmup: int = 1) -> float:
    """Median wall time of `fn` in seconds, after `warmup` calls; repeats until `min_repeats` and `min_seconds`."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() - start < min_seconds):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    times.sort()
    return times[len(times) // 2]


def matmul_peak(dtype: torch.dtype, sizes=(1024, 2048)) -> float:
    """The best GFLOP/s of plain square matmuls of `dtype` at the current thread count."""
    best = 0.0
    for size in sizes:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        seconds = timed(lambda: a @ b, min_repeats=5, min_seconds=0.5 if size >= 1024 else 0.0)
        best = max(best, 2 * size**3 / seconds / 1e9)
    return best


def chunk_flops(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int, chunk: int = 64) -> float:
    """Nominal FLOPs of one chunked delta-rule forward (the algorithm of docs/design.md, 2. Kernels, Chunked form,
    counted the same for every implementation): per chunk Q K^T and K K^T (2 C^2 K each), the triangular solve for [U | W] (C^2 (K + V)),
    W S, Q S and the state update (2 C K V each), and the intra-chunk attention times V' (2 C^2 V)."""
    per_chunk = 4 * chunk**2 * key_dim + chunk**2 * (key_dim + value_dim) + 6 * chunk * key_dim * value_dim
    per_chunk += 2 * chunk**2 * value_dim
    return batch * heads * -(-seq_len // chunk) * per_chunk


def kernel_inputs(gate: str, seq_len: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """L2-normalised q, k, random v, beta in (0, 1) and a mild log-decay (as a trained gate gives)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, seq_len, heads, dim)
    q = F.normalize(torch.randn(shape, generator=generator), dim=-1).to(dtype)
    k = F.normalize(torch.randn(shape, generator=generator), dim=-1).to(dtype)
    v = torch.randn(shape, generator=generator).to(dtype)
    beta = torch.rand(shape[:3], generator=generator)
    g_shape = shape[:3] if gate == "scalar" else shape
    g = -0.1 * torch.rand(g_shape, generator=generator) - 0.001
    return q, k, v, beta, g


def _ours(q, k, v, beta, g):
    from delta_attention.modeling.delta_rule import chunk_delta_rule

    return chunk_delta_rule(q, k, v, beta, g)


def _qwen3_next(q, k, v, beta, g):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return torch_chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)


def _kimi_linear(q, k, v, beta, g):
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention(q, k, v, g, beta, output_final_state=True)


PEERS = {"scalar": ("Qwen3-Next torch_chunk_gated_delta_rule", _qwen3_next),
         "channel": ("KimiLinear chunk_kimi_delta_attention", _kimi_linear)}


def _step(fn, inputs, backward: bool):
    if not backward:
        with torch.no_grad():
            return lambda: fn(*inputs)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    weights = torch.randn(inputs[2].shape)

    def run():
        out, state = fn(*leaves)
        ((out.float() * weights).sum() + state.sum()).backward()
        for leaf in leaves:
            leaf.grad = None

    return run


def run_kernel_benchmark(lengths, heads: int = 9, dim: int = 64, peers: bool = True, log=print,
                         peer_budget_seconds: float = 60.0, min_seconds: float = 1.0) -> dict:
    """Times every (gate, dtype, pass, T) for ours and the peer, both the same way (`timed`: one warm-up call, then
    the median of at least `min_repeats` calls and `min_seconds`); returns a JSON-able dict. A peer whose next
    length would take more than `peer_budget_seconds` in all is skipped from there on."""
    import transformers

    transformers.logging.set_verbosity_error()  # the peers warn that they are falling back to torch
    sizes = (1024, 2048) if min_seconds else (256,)
    peak = {"float32": matmul_peak(torch.float32, sizes), "bfloat16": matmul_peak(torch.bfloat16, sizes)}
    log(f"matmul peak: float32 {peak['float32']:.0f} GFLOP/s, bfloat16 {peak['bfloat16']:.0f} GFLOP/s")
    min_repeats = 3 if min_seconds else 1

    def measure(step) -> float:  # ours and the peer alike
        return timed(step, min_repeats=min_repeats, min_seconds=min_seconds)

    rows = []
    skipped_peer = set()
    for gate in ("scalar", "channel"):
        peer_name, peer = PEERS[gate]
        for dtype in (torch.float32, torch.bfloat16):
            dtype_name = str(dtype).removeprefix("torch.")
            for backward in (False, True):
                for seq_len in lengths:
                    inputs = kernel_inputs(gate, seq_len, heads, dim, dtype)
                    flops = chunk_flops(1, seq_len, heads, dim, dim) * (3 if backward else 1)
                    ours = measure(_step(_ours, inputs, backward))
                    row = {
                        "gate": gate, "dtype": dtype_name, "pass": "fwd+bwd" if backward else "fwd", "T": seq_len,
                        "ours_ms": ours * 1e3, "ours_gflops": flops / ours / 1e9,
                        "ours_peak_fraction": flops / ours / 1e9 / peak[dtype_name], "peer": peer_name,
                    }
                    key = (gate, dtype_name, backward)
                    if peers and key not in skipped_peer:
                        theirs = measure(_step(peer, inputs, backward))
                        row.update(peer_ms=theirs * 1e3, speedup=theirs / ours)
                        # their time grows at least linearly with T (the default lengths grow 4x): stop before a
                        # measurement (warm-up and repeats) would exceed the budget
                        if theirs * 4 * (1 + min_repeats) > peer_budget_seconds:
                            skipped_peer.add(key)
                    rows.append(row)
                    speed = f", peer {row['peer_ms']:.1f} ms, x{row['speedup']:.1f}" if "peer_ms" in row else ""
                    log(f"kernel {gate:7s} {dtype_name:8s} {row['pass']:7s} T={seq_len:5d}: ours {row['ours_ms']:.2f} ms"
                        f" ({row['ours_gflops']:.0f} GFLOP/s, {100 * row['ours_peak_fraction']:.0f}% of peak){speed}")
    return {"matmul_peak_gflops": peak, "heads": heads, "dim": dim, "rows": rows}
