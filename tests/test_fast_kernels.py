"""The fast kernels against the plain per-token reference: chunked forward and custom backward (every gate and
every exact form of the decayed scores), bf16 accuracy, the in-place decode step, piecewise prefill of long
prompts (`DeltaForCausalLM.prefill`), and (only where CUDA and flash-linear-attention exist) parity of fla's kernels
with ours."""

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from delta_attention.modeling import delta_chunk, delta_fla, delta_rule
from delta_attention.modeling.delta_rule import chunk_delta_rule, delta_rule_reference, recurrent_delta_rule

from conftest import HYBRID_LAYERS, delta_rule_inputs, tiny_delta_model
from recording import record_decoder_calls


random_inputs = functools.partial(delta_rule_inputs, seq_len=70, heads=2)


def score_mode(q, k, v, beta, g, chunk):
    """Which exact form of the decayed scores the fast kernel picks for these inputs (see `delta_chunk._Scores`)."""
    qk, _, _, log_decay = delta_chunk._prepare(q, k, v, beta, g, chunk)
    return delta_chunk._Scores(qk, qk, log_decay, None, channel=g is not None and g.dim() == 4).mode


# (gate, decay strength, chunk, score form it exercises)
CASES = [
    ("none", 1.0, 16, "factored"),
    ("none", 1.0, 64, "factored"),
    ("scalar", 1.0, 64, "factored"),
    ("scalar", 12.0, 16, "gamma"),  # a chunk decays by ~e^-96: exp(-G) would overflow
    ("channel", 1.0, 16, "factored"),
    ("channel", 3.5, 64, "blocks"),  # a chunk decays by ~e^-110, a 16-token sub-block by ~e^-28
]


@pytest.mark.parametrize("gate,decay,chunk,mode", CASES)
@pytest.mark.parametrize("seq_len", [70, 130])
def test_score_forms_are_the_ones_under_test(gate, decay, chunk, mode, seq_len):
    """Every case's inputs (those of the forward test below: no decay, mild, steep) select the form it names."""
    assert score_mode(*random_inputs(gate, seq_len=seq_len, decay=decay), chunk) == mode


@pytest.mark.parametrize("gate,decay,chunk,mode", CASES)
@pytest.mark.parametrize("seq_len", [1, 63, 65, 130])
def test_fast_forward_matches_reference(gate, decay, chunk, mode, seq_len):
    q, k, v, beta, g = random_inputs(gate, seq_len=seq_len, decay=decay)
    state = torch.randn(2, 2, 16, 8)
    o_ref, s_ref = delta_rule_reference(q, k, v, beta, g, initial_state=state)
    o, s = delta_chunk.fast_chunk_delta_rule(q, k, v, beta, g, initial_state=state, chunk_size=chunk)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("gate,decay,chunk,mode", CASES)
def test_custom_backward_matches_autograd_through_reference(gate, decay, chunk, mode):
    q, k, v, beta, g = random_inputs(gate, seq_len=70, decay=decay)
    state = torch.randn(2, 2, 16, 8)
    inputs = [q, k, v, beta, state] + ([g] if g is not None else [])
    weights = torch.randn(2, 70, 2, 8)

    def grads(fn, **kw):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        gg = leaves[5] if g is not None else None
        out, final = fn(*leaves[:4], gg, initial_state=leaves[4], **kw)
        ((out * weights).sum() + final.square().sum()).backward()
        return [leaf.grad for leaf in leaves]

    got = grads(delta_chunk.fast_chunk_delta_rule, chunk_size=chunk)
    want = grads(delta_rule_reference)
    for name, a, b in zip(["q", "k", "v", "beta", "state", "g"], got, want):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_segments_carry_the_state_and_its_gradient(monkeypatch, gate):
    """Long inputs run in segments of chunks; with 4 matrices per segment and B*H = 4 every chunk of 16 is its own
    segment (70 tokens: 5), and the results must still equal the reference's."""
    monkeypatch.setattr(delta_chunk, "SEGMENT_MATRICES", 4)
    assert len(delta_chunk._segments(5, 4)) == 5
    test_custom_backward_matches_autograd_through_reference(gate, 1.0, 16, None)


def test_steep_channel_decay_takes_the_exact_elementwise_path():
    # e^-50 per token: a 16-token sub-block decays by e^-800, beyond any factorisation
    q, k, v, beta, g = random_inputs("channel", seq_len=40, decay=50.0)
    assert not delta_chunk.channel_decay_fits(g, 64)
    assert delta_chunk.channel_decay_fits(g / 50.0, 64)
    o_ref, s_ref = delta_rule_reference(q, k, v, beta, g)
    o, s = chunk_delta_rule(q, k, v, beta, g)
    assert torch.isfinite(o).all() and (o - o_ref).abs().max() <= 1e-5 and (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("size", [16, 64, 48])
def test_unit_lower_inverse(size):
    keys = F.normalize(torch.randn(3, 5, size, 16), dim=-1)
    a = torch.rand(3, 5, size, 1) * (keys @ keys.mT)  # diag(beta) K K^T, as the kernel builds it
    want = torch.linalg.solve_triangular(
        a.tril(-1) + torch.eye(size), torch.eye(size).expand_as(a), upper=False, unitriangular=True
    )
    assert (delta_chunk.unit_lower_inverse(a) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_bf16_inputs_stay_within_bf16_rounding(monkeypatch, gate, native_bf16):
    """bf16 q/k/v run bf16 matmuls with float32 decays, inverse and state (on a CPU without native bf16, set here
    by `native_bf16=False`, the kernel computes in float32 instead). Measured against the float32 kernel on
    the same (bf16-rounded) inputs, at T = 256 and 2048 (H = 2, d = 64): relative error (norm of the difference
    over norm of the reference) 4.4e-3 to 4.8e-3 for the output, 3.4e-3 to 3.9e-3 for the final state and 0.5e-3
    to 7.2e-3 for every gradient, independent of T (also 4.8e-3 at T = 8192 without decay). Asserted: 1.5e-2."""
    monkeypatch.setattr(delta_chunk, "_cpu_has_native_bf16", lambda: native_bf16)
    q, k, v, beta, g = random_inputs(gate, batch=1, seq_len=256, heads=2, key_dim=64, value_dim=64, decay=0.1)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    weights = torch.randn(1, 256, 2, 64)
    inputs = [q, k, v, beta] + ([g] if g is not None else [])

    def run(cast):
        leaves = [(x.float() if cast else x).clone().requires_grad_(True) for x in inputs]
        out, final = chunk_delta_rule(*leaves[:4], leaves[4] if g is not None else None)
        ((out.float() * weights).sum() + final.square().sum()).backward()
        return [out.float(), final] + [leaf.grad.float() for leaf in leaves], out.dtype, final.dtype

    got, out_dtype, state_dtype = run(cast=False)
    want, _, _ = run(cast=True)
    assert out_dtype == torch.bfloat16 and state_dtype == torch.float32
    for a, b in zip(got, want):
        assert (a - b).norm() <= 1.5e-2 * b.norm()


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
@pytest.mark.parametrize("seq_len", [1, 3])
def test_inplace_decode_step_updates_the_given_state(gate, seq_len):
    q, k, v, beta, g = random_inputs(gate, seq_len=seq_len)
    state = torch.randn(2, 2, 16, 8)
    original = state.clone()
    o_want, s_want = delta_rule_reference(q, k, v, beta, g, initial_state=state)
    assert not torch.allclose(s_want, original)  # the step does change the state
    buffer = state.clone()
    pointer = buffer.data_ptr()
    o, s = recurrent_delta_rule(q, k, v, beta, g, initial_state=buffer, inplace=True)
    assert s is buffer and buffer.data_ptr() == pointer
    assert (o - o_want).abs().max() <= 1e-6 and (buffer - s_want).abs().max() <= 1e-6
    # without `inplace` the caller's state is left alone and a new one is returned
    o, s = recurrent_delta_rule(q, k, v, beta, g, initial_state=state)
    assert s is not state and s.data_ptr() != state.data_ptr() and torch.equal(state, original)
    assert (o - o_want).abs().max() <= 1e-6 and (s - s_want).abs().max() <= 1e-6


def test_model_decode_writes_into_the_cache_buffers():
    model = tiny_delta_model(layer_types=HYBRID_LAYERS, num_hidden_layers=4, sliding_window=8)
    ids = torch.randint(3, 97, (2, 21))
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids[:, :19]).cache
        buffers = [cache.layers[i].recurrent_states[0] for i in (0, 3)]  # the delta layers' states
        pointers = [buffer.data_ptr() for buffer in buffers]
        steps = [model(ids[:, t : t + 1], cache=cache).logits[:, -1] for t in (19, 20)]
    assert [cache.layers[i].recurrent_states[0] is buffer for i, buffer in zip((0, 3), buffers)] == [True, True]
    assert [buffer.data_ptr() for buffer in buffers] == pointers
    assert (torch.stack(steps, 1) - full[:, 19:]).abs().max() <= 1e-5


@pytest.mark.parametrize("layers", ["delta", "hybrid"])
def test_piecewise_prefill_matches_one_shot(layers):
    extra = {} if layers == "delta" else dict(layer_types=HYBRID_LAYERS, num_hidden_layers=4, sliding_window=8)
    model = tiny_delta_model(**extra)
    ids = torch.randint(3, 97, (2, 100))
    mask = torch.ones(2, 100, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    positions = torch.tensor([70, 5, 99, 33])
    with torch.no_grad():
        full, full_masked = model(ids), model(ids, attention_mask=mask)
        pieces = model.prefill(ids, piece_size=16, logits_to_keep=0)
        last = model.prefill(ids, piece_size=16, logits_to_keep=3)
        chosen = model.prefill(ids, piece_size=16, logits_to_keep=positions)
        masked = model.prefill(ids, attention_mask=mask, piece_size=16, logits_to_keep=0)
        token = torch.randint(3, 97, (2, 1))
        after_pieces = model(token, cache=model.prefill(ids, piece_size=16).cache).logits
        after_one_shot = model(token, cache=model(ids).cache).logits
    assert (pieces.logits - full.logits).abs().max() <= 1e-5
    assert last.logits.shape == (2, 3, 97) and (last.logits - full.logits[:, -3:]).abs().max() <= 1e-5
    assert (chosen.logits - full.logits[:, positions]).abs().max() <= 1e-5
    assert (masked.logits - full_masked.logits)[:, 7:].abs().max() <= 1e-5
    assert (after_pieces - after_one_shot).abs().max() <= 1e-5


def test_forward_does_not_split_long_prompts():
    """`forward` is one call of the decoder however long the input; pieces are `prefill`'s job."""
    model = tiny_delta_model()
    seen = record_decoder_calls(model)
    with torch.no_grad():
        model(torch.randint(3, 97, (1, model.prefill_piece_size + 1)), logits_to_keep=1)
    assert seen == [model.prefill_piece_size + 1]


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates (a length-independence check that is not a timing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_long_prompt_temporaries_do_not_grow_with_length():
    model = tiny_delta_model(layer_types=["linear_attention"] * 2, num_hidden_layers=2)
    seen = record_decoder_calls(model)
    largest = {}
    for length in (256, 1024):
        ids = torch.randint(3, 97, (1, length))
        with torch.no_grad(), LargestTensor() as tracker:
            out = model.prefill(ids, piece_size=64, logits_to_keep=1)
        largest[length] = tracker.largest
        assert out.logits.shape == (1, 1, 97)
    assert max(seen) == 64  # every call of the decoder saw one piece
    assert largest[256] == largest[1024]  # no temporary scales with the prompt (input ids aside: 1024 < largest)


needs_fla = pytest.mark.skipif(
    not (torch.cuda.is_available() and delta_fla._FLA_IMPORTED), reason="needs CUDA and flash-linear-attention"
)


@needs_fla
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_fla_kernels_match_ours_on_cuda(gate):
    q, k, v, beta, g = random_inputs(gate, batch=2, seq_len=300, heads=4, key_dim=64, value_dim=64, decay=0.1)
    state = torch.randn(2, 4, 64, 64) * 0.1
    want_o, want_s = chunk_delta_rule(q, k, v, beta, g, initial_state=state, implementation="fast")
    cuda = [x.cuda() if x is not None else None for x in (q, k, v, beta, g, state)]
    got_o, got_s = chunk_delta_rule(*cuda[:5], initial_state=cuda[5], allow_bf16=True)  # fla's chunk kernels (bf16)
    assert (got_o.cpu() - want_o).norm() <= 2e-2 * want_o.norm()
    assert (got_s.cpu() - want_s).norm() <= 2e-2 * want_s.norm()
    step = [x[:, :1] if x is not None else None for x in cuda[:5]]
    got_o1, got_s1 = recurrent_delta_rule(*step, initial_state=cuda[5], allow_bf16=True)  # fla's fused recurrent
    want_o1, want_s1 = recurrent_delta_rule(*[x.cpu() if x is not None else None for x in step], initial_state=state)
    assert (got_o1.cpu() - want_o1).norm() <= 2e-2 * want_o1.norm()
    assert (got_s1.cpu() - want_s1).norm() <= 2e-2 * want_s1.norm()


def test_fla_is_not_used_on_cpu():
    q, k, v, beta, g = random_inputs("scalar")
    assert not delta_fla.fla_available(q)


def test_benchmark_runs_as_a_module(tmp_path):
    """`python -m delta_attention.scripts.benchmark` takes the flags of `delta-attention benchmark` (it handed `run`
    the parsed tuple instead of the options, and failed before measuring anything)."""
    import json
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "delta_attention.scripts.benchmark", "--smoke", "--parts", "decode",
               "--output_dir", str(tmp_path)]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "benchmark.json").read_text())["decode"]


def test_benchmark_pipeline_runs_end_to_end(tmp_path):
    """`delta-attention benchmark --smoke`: tiny models and sizes through the parts, table, JSON and plot. (The
    long-prompt part runs each length in a spawned process; here its worker runs in this one, to stay fast.)"""
    import json
    import queue

    from delta_attention.modeling import few_rows_linear
    from delta_attention.scripts import bench_models, bench_report, benchmark

    options = benchmark.Options(smoke=True, parts="kernel,decode,prefill", output_dir=str(tmp_path),
                                plot=str(tmp_path / "copy.png"))
    assert benchmark.run(options) == 0
    results = json.loads((tmp_path / "benchmark.json").read_text())
    assert {"kernel", "decode", "prefill", "environment"} <= set(results)
    vendor = results["environment"]["cpu_vendor"]  # which few-row rules the products followed
    assert vendor == (few_rows_linear.cpu_vendor() or "unknown")
    assert f"({vendor})" in (tmp_path / "benchmark.md").read_text()
    kernel = results["kernel"]
    measured = {(row["gate"], row["dtype"], row["pass"], row["T"]) for row in kernel["rows"]}
    assert len(kernel["rows"]) == len(measured) == 8  # every (gate, dtype, pass) at the smoke length, once
    assert measured == {(gate, dtype, step, 130) for gate in ("scalar", "channel") for dtype in ("float32", "bfloat16")
                        for step in ("fwd", "fwd+bwd")}
    table = "\n".join(bench_report.kernel_table(kernel))
    for row in kernel["rows"]:
        assert row["ours_ms"] > 0 and row["peer_ms"] > 0
        assert row["speedup"] == pytest.approx(row["peer_ms"] / row["ours_ms"])
        peak = kernel["matmul_peak_gflops"][row["dtype"]]
        assert row["ours_peak_fraction"] == pytest.approx(row["ours_gflops"] / peak)
        assert f"| {row['gate']} | {row['dtype']} | {row['pass']} | {row['T']} | {row['ours_ms']:,.2f} |" in table
        assert f"| {row['peer_ms']:,.1f} | {row['speedup']:.1f}x |" in table
    delta_sizes = {row["cache_bytes"] for row in results["decode"]["rows"] if row["model"] == "delta"}
    assert len(delta_sizes) == 1 and min(delta_sizes) > 0  # an all-delta cache does not grow with the context
    assert (tmp_path / "benchmark.png").stat().st_size > 0 and (tmp_path / "copy.png").exists()
    assert "| gate | inputs | pass |" in (tmp_path / "benchmark.md").read_text()

    rows = queue.Queue()
    for length in (128, 512):
        bench_models._long_prompt_child(length, "float32", torch.get_num_threads(), benchmark.SMOKE_SHAPE, 64, rows)
    short, long = rows.get(), rows.get()
    assert long["tokens"] == 512 and long["piece_size"] == 64 and long["peak_rss_bytes"] > 0
    long_results = {"model": benchmark.SMOKE_SHAPE, "piece_size": 64, "rows": [short, long],
                    "peak_rss_ratio": long["peak_rss_bytes"] / short["peak_rss_bytes"]}
    assert "| 512 |" in "\n".join(bench_report.long_table(long_results))


FLA_KERNELS = ("_fla_chunk_delta", "_fla_recurrent_delta", "_fla_chunk_gated", "_fla_recurrent_gated",
               "_fla_chunk_kda", "_fla_recurrent_kda")


def fla_stand_in(monkeypatch) -> list[dict]:
    """fla "on CUDA" without either: every tensor claims `is_cuda` and fla's six kernels are replaced by a stand-in
    with fla's keyword interface, `function(q=, k=, v=, beta=, scale=, initial_state=, output_final_state=, g=,
    state_v_first=)` (q, k, v [B, T, H, D], one head count for all, the state [B, H, K, V] K-first) returning
    `(o, final_state)`. It computes the per-token reference in float32 and records each call in the list returned.
    Also resets the entry points' once-only backend log."""
    calls = []

    def stand_in(q, k, v, beta, scale, initial_state, output_final_state, g=None, state_v_first=None, **kwargs):
        calls.append(dict(dtype=q.dtype, state=None if initial_state is None else initial_state.dtype,
                          state_v_first=state_v_first, gated=g is not None, heads=(q.shape[2], k.shape[2])))
        assert output_final_state and state_v_first is False and not kwargs
        out, final = delta_rule_reference(q.float(), k.float(), v.float(), beta.float(), g, initial_state, scale)
        return out.to(q.dtype), final

    for name in FLA_KERNELS:
        monkeypatch.setattr(delta_fla, name, stand_in, raising=False)
    monkeypatch.setattr(delta_fla, "_FLA_IMPORTED", True)
    monkeypatch.setattr(delta_rule, "_LOGGED", set(), raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return calls


def bf16_inputs(gate, **kwargs):
    """`random_inputs` rounded to bf16 (g, a log-decay, stays float32): what fla's kernels run as they are."""
    q, k, v, beta, g = random_inputs(gate, **kwargs)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16(), g


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_fla_dispatch_plumbing_with_a_stand_in(monkeypatch, gate):
    """What the dispatch hands over when float32 inputs opt in to fla (`allow_bf16=True`): 16-bit q/k/v, float32
    [B, H, K, V] state, the K-first layout asked for explicitly, the output cast back to float32."""
    calls = fla_stand_in(monkeypatch)
    q, k, v, beta, g = random_inputs(gate, seq_len=20)
    state = torch.randn(2, 2, 16, 8)
    o, s = chunk_delta_rule(q, k, v, beta, g, initial_state=state, allow_bf16=True)
    o1, s1 = recurrent_delta_rule(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], None if g is None else g[:, :1],
                                  initial_state=state, allow_bf16=True)
    monkeypatch.undo()
    o_ref, s_ref = delta_rule_reference(q, k, v, beta, g, initial_state=state)
    assert len(calls) == 2 and all(c["dtype"] == torch.bfloat16 and c["state"] == torch.float32 for c in calls)
    assert all(c["gated"] == (gate != "none") for c in calls)
    assert o.dtype == torch.float32 and (o - o_ref).abs().max() <= 2e-2 and (s - s_ref).abs().max() <= 2e-2
    assert (o1 - o_ref[:, :1]).abs().max() <= 2e-2


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_fla_decode_step_honours_inplace(monkeypatch, gate):
    """On fla's recurrent kernels too, `inplace=True` leaves the new state in the caller's buffer (the cache's)."""
    calls = fla_stand_in(monkeypatch)
    q, k, v, beta, g = bf16_inputs(gate, seq_len=1)
    buffer = torch.randn(2, 2, 16, 8)
    _, s_want = delta_rule_reference(q, k, v, beta, g, initial_state=buffer)
    pointer = buffer.data_ptr()
    _, s = recurrent_delta_rule(q, k, v, beta, g, initial_state=buffer, inplace=True)
    monkeypatch.undo()
    assert len(calls) == 1  # the fla path ran
    assert s is buffer and buffer.data_ptr() == pointer and (buffer - s_want).abs().max() <= 1e-5


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_float32_inputs_stay_float32_with_fla_installed(monkeypatch, gate):
    """float32 inputs on CUDA run the float32 torch kernels (fla would compute in bf16) unless the caller opts in."""
    calls = fla_stand_in(monkeypatch)
    q, k, v, beta, g = random_inputs(gate, seq_len=20)
    state = torch.randn(2, 2, 16, 8)
    o, s = chunk_delta_rule(q, k, v, beta, g, initial_state=state)
    o1, s1 = recurrent_delta_rule(q, k, v, beta, g, initial_state=state)
    monkeypatch.undo()
    o_ref, s_ref = delta_rule_reference(q, k, v, beta, g, initial_state=state)
    assert calls == []
    assert o.dtype == o1.dtype == torch.float32
    for out, final in ((o, s), (o1, s1)):
        assert (out - o_ref).abs().max() <= 1e-5 and (final - s_ref).abs().max() <= 1e-5


def test_steep_channel_decay_takes_the_exact_path_with_fla_installed(monkeypatch):
    """The steep per-channel decay of `test_steep_channel_decay_takes_the_exact_elementwise_path` routes to the
    plain chunked form on CUDA too, not to fla's factorised chunk kernel."""
    calls = fla_stand_in(monkeypatch)
    q, k, v, beta, g = bf16_inputs("channel", seq_len=40, decay=50.0)
    o, s = chunk_delta_rule(q, k, v, beta, g)
    monkeypatch.undo()
    o_exact, s_exact = chunk_delta_rule(q, k, v, beta, g, implementation="elementwise")
    assert calls == [] and torch.equal(o, o_exact) and torch.equal(s, s_exact)


def backend_records(caplog):
    return [r for r in caplog.records if r.name == delta_rule.__name__]


def test_backend_choice_is_logged_once(monkeypatch, caplog):
    calls = fla_stand_in(monkeypatch)
    caplog.set_level(logging.INFO, logger=delta_rule.__name__)
    q, k, v, beta, g = bf16_inputs("scalar", seq_len=20)
    for _ in range(2):
        chunk_delta_rule(q, k, v, beta, g)
        recurrent_delta_rule(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], g[:, :1])
    monkeypatch.undo()
    assert len(calls) == 4
    assert [r.getMessage() for r in backend_records(caplog)] == ["delta rule: fla kernels (CUDA)"]


def test_broken_fla_install_is_reported_once_and_falls_back(monkeypatch, caplog):
    """fla installed but failing to import (here: Triton without a toolchain) is a WARNING naming the error, once;
    the torch kernels run."""
    monkeypatch.setattr(delta_fla, "_FLA_IMPORTED", False)
    monkeypatch.setattr(delta_fla, "_FLA_IMPORT_ERROR", RuntimeError("Triton: no CUDA toolchain"), raising=False)
    monkeypatch.setattr(delta_rule, "_LOGGED", set(), raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    caplog.set_level(logging.INFO, logger=delta_rule.__name__)
    q, k, v, beta, g = bf16_inputs("scalar", seq_len=20)
    o, s = chunk_delta_rule(q, k, v, beta, g)
    chunk_delta_rule(q, k, v, beta, g)
    monkeypatch.undo()
    o_fast, s_fast = chunk_delta_rule(q, k, v, beta, g, implementation="fast")
    assert torch.equal(o, o_fast) and torch.equal(s, s_fast)
    records = backend_records(caplog)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.WARNING, "delta rule: torch kernels: fla import failed: RuntimeError: Triton: no CUDA toolchain")]
    assert delta_fla.import_failure(ModuleNotFoundError("No module named 'fla'", name="fla")) == "fla not installed"
    assert delta_fla.import_failure(ModuleNotFoundError("No module named 'triton'", name="triton")) == (
        "fla import failed: ModuleNotFoundError: No module named 'triton'")


def test_benchmark_builds_the_lean_all_delta_layouts_beside_llama():
    """`benchmark --models`: "delta-gqa" (one state per KV head) and "delta-gqa-ungated" (also no output gate) have
    Llama's q/k/v/o shapes, so the ungated one reads Llama's weights plus a few per layer; their states are a third
    of all-delta's (3 of 9 heads' states at SmolLM2's shape, 1 of 2 here); a name outside `MODELS` is refused."""
    from delta_attention.scripts import bench_models, bench_report
    from delta_attention.scripts.benchmark import SMOKE_SHAPE, Options, run

    which = ("delta", "delta-gqa", "delta-gqa-ungated", "llama")
    models = bench_models.build_models(torch.float32, SMOKE_SHAPE, which=which)
    assert list(models) == list(which)
    counts = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    llama_attention = dict(models["llama"].model.layers[0].self_attn.named_parameters())
    for name in ("delta-gqa", "delta-gqa-ungated"):
        attention = dict(models[name].model.layers[0].self_attn.named_parameters())
        for projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert attention[f"{projection}.weight"].shape == llama_attention[f"{projection}.weight"].shape
    assert any(n.endswith("self_attn.g_proj.weight") for n, _ in models["delta-gqa"].named_parameters())
    assert not any("g_proj" in n for n, _ in models["delta-gqa-ungated"].named_parameters())
    # per layer beyond Llama: the conv (64 + 32 + 32 channels x 4), b_proj (beta: 2 x 64 and a bias of 2), a_proj
    # (decay: 2 x 64), dt_bias and A_log (2 each), o_norm (64)
    extra = 128 * 4 + 2 * 64 + 2 + 2 * 64 + 2 + 2 + 64
    assert counts["delta-gqa-ungated"] - counts["llama"] == SMOKE_SHAPE["num_hidden_layers"] * extra
    assert counts["delta"] > counts["delta-gqa"] > counts["delta-gqa-ungated"]

    decode = bench_models.run_decode_benchmark(models, [16], steps=2, log=lambda *_: None)
    rows = {row["model"]: row for row in decode["rows"]}
    assert list(rows) == ["one delta layer", "delta", "delta-gqa", "delta-gqa-ungated", "llama", "llama+StaticCache"]
    assert rows["delta-gqa"]["cache_bytes"] == rows["delta-gqa-ungated"]["cache_bytes"]
    states = 4 * SMOKE_SHAPE["num_hidden_layers"] * 16 * 16  # float32 [1, heads, 16, 16] per layer
    conv = 4 * SMOKE_SHAPE["num_hidden_layers"] * 4  # float32 [1, channels, 4] per layer
    assert rows["delta"]["cache_bytes"] == states * 4 + conv * (3 * 64)
    assert rows["delta-gqa"]["cache_bytes"] == states * 2 + conv * 128

    checks = "\n".join(bench_report.target_checks({"decode": decode}))
    for name in ("delta", "delta-gqa", "delta-gqa-ungated"):
        ratio = rows[name]["ms_per_token"] / rows["llama+StaticCache"]["ms_per_token"]
        assert f"{name} decode at 16 vs llama+StaticCache: {ratio:.2f}x its time (target <= 1.0x)" in checks
    with pytest.raises(ValueError, match=r"unknown model\(s\) \['delta-lean'\] in --models; choose from"):
        run(Options(smoke=True, parts="decode", models="delta,delta-lean"))
    with pytest.raises(ValueError, match=r"unknown benchmark model\(s\) \['gpt'\]"):
        bench_models.build_models(torch.float32, SMOKE_SHAPE, which=["gpt"])
