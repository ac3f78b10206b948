"""The pieces the fast chunk kernel (`modeling/delta_chunk.py`) uses to save elementwise passes, each against a plain
computation of the same thing: the triangular inverse that reads only the strict lower triangle, the causal masks
cached across calls (also when first built under inference mode), the output gradient scaled during its layout
copy, and chunks written back to the token layout through views (whole or one segment at a time). The kernel's outputs and gradients against the per-token reference are in test_fast_kernels.py and
test_gqa_kernels.py."""

import pytest
import torch
import torch.nn.functional as F

from delta_attention.modeling import delta_chunk
from delta_attention.modeling.delta_rule import delta_rule_reference

from conftest import delta_rule_inputs


@pytest.mark.parametrize("size", [64, 16, 48])
def test_unit_lower_inverse_reads_only_the_strict_lower_triangle(size):
    """The kernel hands the solve its [C, C] score block as it is: whatever lies on and above the diagonal (here
    large finite values) must not change (I + strict_tril(a))^-1, checked against a general inverse."""
    keys = F.normalize(torch.randn(4, 3, size, 16, dtype=torch.float64), dim=-1)
    a = torch.rand(4, 3, size, 1, dtype=torch.float64) * (keys @ keys.mT)  # diag(beta) K K^T
    garbage = a + torch.triu(torch.full((size, size), 1e6, dtype=torch.float64))
    want = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + a.tril(-1))
    got = delta_chunk.unit_lower_inverse(garbage.float())
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5


def test_causal_masks_are_built_once_per_size_diagonal_device_and_dtype():
    mask = delta_chunk.causal_mask(8, 0, torch.device("cpu"), torch.float32)
    assert delta_chunk.causal_mask(8, 0, torch.device("cpu"), torch.float32) is mask
    assert torch.equal(mask, torch.ones(8, 8).tril())
    strict = delta_chunk.causal_mask(8, -1, torch.device("cpu"), torch.float32)
    assert torch.equal(strict, torch.ones(8, 8).tril(-1))
    half = delta_chunk.causal_mask(8, 0, torch.device("cpu"), torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), mask)
    boolean = delta_chunk.causal_mask(8, 0, torch.device("cpu"), torch.bool)
    assert boolean.dtype == torch.bool and torch.equal(boolean, mask.bool())
    other_device = delta_chunk.causal_mask(8, 0, torch.device("meta"), torch.float32)
    assert other_device.device.type == "meta" and other_device.shape == (8, 8)


def test_a_mask_first_built_in_inference_mode_still_serves_autograd():
    """The cache outlives the call that filled it: a mask first needed under `torch.inference_mode` must be a normal
    tensor, or autograd-tracked code using it later fails ("Inference tensors cannot be saved for backward")."""
    delta_chunk.causal_mask.cache_clear()
    with torch.inference_mode():
        mask = delta_chunk.causal_mask(8, 0, torch.device("cpu"), torch.float32)
    assert not mask.is_inference()
    x = torch.randn(8, 8, requires_grad=True)
    (x * mask).sum().backward()
    assert torch.equal(x.grad, mask)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_kernel_after_inference_mode_call_matches_reference_gradients(gate):
    """Inference first (masks cached inside `torch.inference_mode`), then a training call on the same shapes: the
    gradients still match autograd through the per-token reference (float32, 1e-4)."""
    delta_chunk.causal_mask.cache_clear()
    q, k, v, beta, g = delta_rule_inputs(gate, seq_len=70, heads=2)
    with torch.inference_mode():
        delta_chunk.fast_chunk_delta_rule(q, k, v, beta, g, chunk_size=16)
    weights = torch.randn(2, 70, 2, 8)

    def grads(fn, **kw):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g)]
        out, final = fn(*leaves, **kw)
        ((out * weights).sum() + final.square().sum()).backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(grads(delta_chunk.fast_chunk_delta_rule, chunk_size=16), grads(delta_rule_reference)):
        assert (got - want).abs().max() <= 1e-4


@pytest.mark.parametrize("seq_len", [128, 100])
def test_to_chunks_scales_in_the_same_pass(seq_len):
    """`to_chunks(..., scale=s)` (the backward's scaled output gradient) equals s times the plain layout copy, with
    the padded tail still zero."""
    x = torch.randn(2, seq_len, 3, 8)
    plain = delta_chunk.to_chunks(x, 64, torch.float32)
    scaled = delta_chunk.to_chunks(x, 64, torch.float32, scale=0.125)
    assert torch.equal(scaled, plain * 0.125)
    if seq_len % 64:
        assert not scaled[-1, :, :, seq_len % 64 :].any()
    as_bf16 = delta_chunk.to_chunks(x, 64, torch.bfloat16, scale=0.125)
    assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, (plain * 0.125).bfloat16())


def plain_from_chunks(x, seq_len):
    """[N, B, H, C, ...] -> [B, T, H, ...] the obvious way: permute, reshape (a copy), cut the padding."""
    n_chunks, batch, heads, chunk = x.shape[:4]
    x = x.permute(1, 0, 3, 2, *range(4, x.dim())).reshape(batch, n_chunks * chunk, heads, *x.shape[4:])
    return x[:, :seq_len]


@pytest.mark.parametrize("seq_len", [1, 63, 64, 130])
@pytest.mark.parametrize("trailing", [(), (5,)])
def test_from_chunks_matches_the_plain_layout(seq_len, trailing):
    x = torch.randn(-(-seq_len // 64), 2, 3, 64, *trailing)
    want = plain_from_chunks(x, seq_len)
    assert torch.equal(delta_chunk.from_chunks(x, seq_len, torch.float32), want)
    assert torch.equal(delta_chunk.from_chunks(x, seq_len, torch.float32, scale=0.5), want * 0.5)
    assert torch.equal(delta_chunk.from_chunks(x, seq_len, torch.bfloat16), want.bfloat16())


def test_segments_written_one_at_a_time_fill_the_whole_output():
    """The backward writes each segment's chunks at its first token; the last segment's padding is dropped."""
    x = torch.randn(5, 2, 3, 16, 4)  # 5 chunks of 16 tokens, 70 real tokens
    out = torch.full((2, 70, 3, 4), float("nan"))
    for start, end in [(3, 5), (0, 3)]:
        delta_chunk.write_from_chunks(out, x[start:end], first_token=start * 16)
    assert torch.equal(out, plain_from_chunks(x, 70))


@pytest.fixture
def fresh_bf16_check():
    """`_cpu_has_native_bf16` is cached per process: cleared before and after a test that fakes the CPU."""
    delta_chunk._cpu_has_native_bf16.cache_clear()
    yield
    delta_chunk._cpu_has_native_bf16.cache_clear()


def test_cpu_without_native_bf16_is_detected_and_logged_once(monkeypatch, caplog, fresh_bf16_check):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with caplog.at_level("INFO", logger=delta_chunk.logger.name):
        assert not delta_chunk.bf16_matmuls(torch.device("cpu"))
        assert not delta_chunk.bf16_matmuls(torch.device("cpu"))
    assert [record.getMessage() for record in caplog.records] == [
        "delta rule: this CPU has no native bf16 matmuls (AMX, AVX512-BF16): bf16 inputs run the chunk kernel in "
        "float32 and get bf16 outputs"]
    assert delta_chunk.bf16_matmuls(torch.device("meta"))  # off CPU bf16 matmuls stay


def test_cpu_with_either_bf16_feature_keeps_bf16_matmuls(monkeypatch, fresh_bf16_check):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert delta_chunk.bf16_matmuls(torch.device("cpu"))


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_bf16_inputs_without_native_bf16_are_the_float32_kernel_rounded(monkeypatch, gate):
    """Without native bf16 the kernel computes in float32: the output is exactly the float32 kernel's on the same
    bf16-rounded inputs, cast to bf16, and the state is float32; the gradients differ only by the bf16 rounding of
    the output gradient and of the returned q, k, v gradients (relative 1e-2)."""
    monkeypatch.setattr(delta_chunk, "_cpu_has_native_bf16", lambda: False)
    q, k, v, beta, g = delta_rule_inputs(gate, seq_len=70, heads=2, key_dim=16, value_dim=8)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    weights = torch.randn(2, 70, 2, 8)

    def run(cast):
        leaves = [(x.float() if cast else x).clone().requires_grad_(True) for x in (q, k, v, beta, g)]
        out, final = delta_chunk.fast_chunk_delta_rule(*leaves, chunk_size=16)
        ((out.float() * weights).sum() + final.square().sum()).backward()
        return out, final, [leaf.grad for leaf in leaves]

    out, final, grads = run(cast=False)
    want_out, want_final, want_grads = run(cast=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert torch.equal(out, want_out.bfloat16()) and torch.equal(final, want_final)
    for got, want, leaf in zip(grads, want_grads, (q, k, v, beta, g)):
        assert got.dtype == leaf.dtype
        assert (got.float() - want).norm() <= 1e-2 * want.norm()


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_the_kernel_keeps_its_own_dtypes_under_autocast(gate):
    """bf16 autocast (distillation's default mixed precision) reaches the kernel's forward and backward; the kernel
    chooses its dtypes from its inputs, so float32 inputs give the float32 results, gradients included (autocast
    used to turn some of its in-place matmuls bf16 and others not: "Input dtypes must be the same")."""
    inputs = delta_rule_inputs(gate, seq_len=130, decay=0.5)

    def run(autocast: bool):
        leaves = [None if t is None else t.clone().requires_grad_() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, final = delta_chunk.fast_chunk_delta_rule(*leaves)
            (out.square().sum() + final.sum()).backward()
        return [out, final, *[t.grad for t in leaves if t is not None]]

    for plain, autocast in zip(run(False), run(True)):
        assert autocast.dtype == plain.dtype == torch.float32
        torch.testing.assert_close(autocast, plain, rtol=0, atol=0)
