"""`few_rows_linear` (weight @ x^T for a few rows at CPU float32 and bf16 inference) against `F.linear`, the
reference, under the float32 rules of each CPU vendor (`cpu_vendor`, pinned here: the AMD rules unless a test says
otherwise, whatever CPU runs the tests).

Tolerance: float32 within 1e-5 of `F.linear` relative to the output's largest entry (the same sums in another order;
MKL's order also depends on the weight's memory alignment, so a model loaded from disk agrees with its fresh copy to
this tolerance, not bit for bit); bf16 products equal to `F.linear`'s on the shapes tested here (both sum in float32
and round once; a model's steps within 2^-6 of its largest logit, since a sum in another order can round a last bit
the other way). Everywhere the path
does not apply the result is `F.linear`'s, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaMLP

from conftest import HYBRID_LAYERS, prefill_then_decode, tiny_delta_config, tiny_delta_model
from delta_attention.modeling import few_rows_linear as few_rows
from delta_attention.modeling.few_rows_linear import (BF16_ROWS, FEW_ROWS, INTEL_LARGE_FEWEST, LARGE_ROWS,
                                                      LARGE_WEIGHT_BYTES, SHORT_ROW, DeltaLinear, cpu_vendor,
                                                      few_rows_linear, takes_few_rows)
from delta_attention.modeling.modeling_delta import DeltaAttention, DeltaMLP

RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def vendor(monkeypatch):
    """The float32 rules of an AMD CPU, unless a test sets `vendor[0]` to another vendor."""
    name = ["AuthenticAMD"]
    monkeypatch.setattr(few_rows, "cpu_vendor", lambda: name[0])
    return name


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return (actual - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max()


@pytest.mark.parametrize("shape", [(1, 2, 48), (1, 3, 48), (2, 2, 48), (4, 48), (3, 1, 48), (2, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_few_rows_equal_f_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        assert takes_few_rows(x, linear.weight)
        output = few_rows_linear(x, linear.weight, linear.bias)
        assert output.shape == (*shape[:-1], 80)
        assert close(output, F.linear(x, linear.weight, linear.bias))


def test_non_contiguous_rows():
    torch.manual_seed(0)
    weight, x = torch.randn(80, 48), torch.randn(1, 48, 3).transpose(1, 2)  # [1, 3, 48] with strides of a transpose
    with torch.no_grad():
        assert close(few_rows_linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("case", ["one row", "too many rows", "autograd", "float16", "no rows"])
def test_elsewhere_it_is_f_linear_bit_for_bit(case):
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    rows = {"one row": 1, "too many rows": FEW_ROWS + 1, "no rows": 0}.get(case, 2)
    x = torch.randn(1, rows, 48)
    if case == "float16":
        weight, bias, x = weight.half(), bias.half(), x.half()
    with torch.set_grad_enabled(case == "autograd"):
        assert not takes_few_rows(x, weight)
        assert torch.equal(few_rows_linear(x, weight, bias), F.linear(x, weight, bias))


def large_weight(inputs: int) -> torch.Tensor:
    """A float32 weight of exactly `LARGE_WEIGHT_BYTES` with `inputs` per row."""
    return torch.randn(LARGE_WEIGHT_BYTES // 4 // inputs, inputs)


@pytest.mark.parametrize("rows", [1, 2, 5, 11, LARGE_ROWS])
def test_a_large_weight_with_short_rows_takes_1_to_16_rows(rows):
    torch.manual_seed(0)
    weight = large_weight(SHORT_ROW // 8)
    x = torch.randn(1, rows, weight.shape[1])
    with torch.no_grad():
        assert takes_few_rows(x, weight)
        assert takes_few_rows(x, weight[1:]) == (2 <= rows <= FEW_ROWS)  # one output less: not large
        assert close(few_rows_linear(x, weight), F.linear(x, weight))


def test_a_large_weight_with_long_rows_takes_2_to_16_rows():
    torch.manual_seed(0)
    weight = large_weight(2 * SHORT_ROW)
    with torch.no_grad():
        assert not takes_few_rows(torch.randn(1, weight.shape[1]), weight)  # one row: its gemv won
        x = torch.randn(2, weight.shape[1])
        assert takes_few_rows(x, weight) and close(few_rows_linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("inputs", [SHORT_ROW // 8, 2 * SHORT_ROW])
def test_a_large_weight_is_f_linear_bit_for_bit_beyond_16_rows(inputs):
    torch.manual_seed(0)
    weight = large_weight(inputs)
    x = torch.randn(LARGE_ROWS + 1, inputs)
    with torch.no_grad():
        assert not takes_few_rows(x, weight)
        assert torch.equal(few_rows_linear(x, weight), F.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 2, 4, INTEL_LARGE_FEWEST - 1, INTEL_LARGE_FEWEST, 11, LARGE_ROWS, LARGE_ROWS + 1])
def test_on_intel_float32_takes_the_path_for_large_weights_from_8_rows_only(vendor, rows):
    vendor[0] = "GenuineIntel"
    torch.manual_seed(0)
    large, small = large_weight(SHORT_ROW // 8), torch.randn(80, SHORT_ROW // 8)
    x = torch.randn(1, rows, large.shape[1])
    with torch.no_grad():
        assert takes_few_rows(x, large) == (INTEL_LARGE_FEWEST <= rows <= LARGE_ROWS)
        assert not takes_few_rows(x, small)
        assert close(few_rows_linear(x, large), F.linear(x, large))
        assert torch.equal(few_rows_linear(x, small), F.linear(x, small))
    vendor[0] = "AuthenticAMD"
    with torch.no_grad():
        assert takes_few_rows(x, large) == (rows <= LARGE_ROWS)


@pytest.mark.parametrize("vendor_name", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, BF16_ROWS])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("size", ["small", "large"])
def test_bf16_takes_the_path_for_1_to_32_rows_and_equals_f_linear(vendor, vendor_name, rows, bias, size):
    vendor[0] = vendor_name
    torch.manual_seed(0)
    weight = (torch.randn(80, 48) if size == "small" else large_weight(SHORT_ROW // 8)[:4096]).bfloat16()
    bias = torch.randn(weight.shape[0]).bfloat16() if bias else None
    x = torch.randn(1, rows, weight.shape[1]).bfloat16()
    with torch.no_grad():
        assert takes_few_rows(x, weight)
        assert not takes_few_rows(torch.randn(BF16_ROWS + 1, weight.shape[1]).bfloat16(), weight)
        output = few_rows_linear(x, weight, bias)
        assert output.dtype == torch.bfloat16 and torch.equal(output, F.linear(x, weight, bias))


def test_cpu_vendor_is_the_processor_s_own_name():
    vendor = cpu_vendor.__wrapped__()  # (the fixture replaces the module's function, not this one)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            named = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")]
    except OSError:
        named = []
    if named:
        assert vendor == named[0]
    else:
        assert isinstance(vendor, str)


def test_gradients_flow_through_a_delta_linear_as_through_nn_linear():
    torch.manual_seed(0)
    plain = torch.nn.Linear(48, 80)
    ours = DeltaLinear(48, 80)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(1, 2, 48)
    plain(x).square().sum().backward()
    ours(x).square().sum().backward()
    assert torch.equal(ours.weight.grad, plain.weight.grad) and torch.equal(ours.bias.grad, plain.bias.grad)


def test_the_switch_keeps_f_linear(monkeypatch):
    torch.manual_seed(0)
    layer = DeltaLinear(48, 80)
    x = torch.randn(1, 2, 48)  # rows the path would take
    monkeypatch.setattr(DeltaLinear, "few_rows", False)
    with torch.no_grad():
        assert takes_few_rows(x, layer.weight)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_delta_mlp_is_llama_mlp():
    config = tiny_delta_config()
    torch.manual_seed(0)
    ours, llama = DeltaMLP(config), LlamaMLP(config)
    assert ours.state_dict().keys() == llama.state_dict().keys()
    ours.load_state_dict(llama.state_dict())
    x = torch.randn(2, 5, config.hidden_size)  # 10 rows: F.linear on both sides
    with torch.no_grad():
        assert torch.equal(ours(x), llama(x))


@pytest.fixture
def few_row_calls(monkeypatch):
    """Counts the products `DeltaLinear` takes as weight @ x^T (a path that silently never ran would pass)."""
    calls = []
    original = few_rows.few_rows_linear

    def counted(x, weight, bias=None):
        calls.append(takes_few_rows(x, weight))
        return original(x, weight, bias)

    monkeypatch.setattr(few_rows, "few_rows_linear", counted)
    return calls


def test_a_hybrid_verification_and_a_two_row_decode_take_every_product_few_rows(few_row_calls, monkeypatch):
    monkeypatch.setattr(DeltaAttention, "fuse_projections", False)  # every `DeltaLinear` called on its own
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    linears = sum(isinstance(m, DeltaLinear) for m in model.modules())
    assert not any(type(m) is torch.nn.Linear for m in model.modules())  # every product of the model, LM head too
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        full, stepped, _ = prefill_then_decode(model, ids, prefill=9)  # decode steps of two rows (the batch)
        cache = model(ids[:1, :9]).cache
        cache.activate_past_recording()
        verified = model(ids[:1, 9:], cache=cache).logits  # a verification of three tokens
        monkeypatch.setattr(DeltaLinear, "few_rows", False)
        _, reference, _ = prefill_then_decode(model, ids, prefill=9)
    # the full forward (24 rows) and the prefill (18), three decode steps, the verification's prefill (9) and
    # block: every linear of the model once each
    assert len(few_row_calls) == 7 * linears
    taken = [few_row_calls[i * linears : (i + 1) * linears] for i in range(7)]
    assert [all(t) for t in taken] == [False, False, True, True, True, False, True]
    assert not any(taken[0] + taken[1] + taken[5])
    assert close(stepped, reference) and close(stepped, full) and close(verified, full[:1, 9:])


def test_a_bf16_decode_step_takes_every_product_few_rows_and_equals_f_linear(few_row_calls, monkeypatch):
    monkeypatch.setattr(DeltaAttention, "fuse_projections", False)
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).to(torch.bfloat16)
    linears = sum(isinstance(m, DeltaLinear) for m in model.modules())
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        _, stepped, _ = prefill_then_decode(model, ids, prefill=9)
        steps = few_row_calls[-3 * linears :]  # the three one-token steps
        monkeypatch.setattr(DeltaLinear, "few_rows", False)
        _, reference, _ = prefill_then_decode(model, ids, prefill=9)
    assert len(steps) == 3 * linears and all(steps)
    # to bf16 rounding: a product can round its last bit the other way, and four layers carry that on
    assert (stepped.float() - reference.float()).abs().max() <= 2**-6 * reference.float().abs().max()


def test_one_token_decode_is_f_linear_bit_for_bit(few_row_calls, monkeypatch):
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        _, stepped, _ = prefill_then_decode(model, ids, prefill=9)
        monkeypatch.setattr(DeltaLinear, "few_rows", False)
        _, reference, _ = prefill_then_decode(model, ids, prefill=9)
    assert few_row_calls and not any(few_row_calls)
    assert torch.equal(stepped, reference)


def test_a_long_verification_and_a_decode_step_take_the_path_for_a_large_lm_head_only(few_row_calls, monkeypatch):
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    head = model.lm_head.weight
    monkeypatch.setattr(few_rows, "LARGE_WEIGHT_BYTES", head.numel() * head.element_size())  # the head is large
    assert all(m.weight.numel() < head.numel() for m in model.modules() if isinstance(m, DeltaLinear) and m
               is not model.lm_head)
    ids = torch.randint(3, 97, (1, 20))
    with torch.no_grad():
        cache = model(ids[:, :9]).cache
        cache.activate_past_recording()
        few_row_calls.clear()
        verified = model(ids[:, 9:], cache=cache).logits  # 11 rows: a verification of 10 drafted tokens
        assert few_row_calls[-1] and not any(few_row_calls[:-1])  # the LM head runs last
        few_row_calls.clear()
        cache = model(ids[:, :19]).cache
        stepped = model(ids[:, 19:], cache=cache).logits  # one token: the head (short rows) too
        assert few_row_calls[-1] and not any(few_row_calls[:-1])
        monkeypatch.setattr(DeltaLinear, "few_rows", False)
        reference = model(ids).logits
    assert close(verified, reference[:, 9:]) and close(stepped, reference[:, 19:])
