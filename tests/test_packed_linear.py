"""Packed weights (`pack_linear_weights`, oneDNN's prepacked layout at CPU float32 inference) against `F.linear`.

Tolerance: within 1e-5 of `F.linear` relative to the output's largest entry (the same sums in another order), as for
`few_rows_linear`. Where a packed layer does not take its packed copy, it is the unpacked layer, bit for bit."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import HYBRID_LAYERS, prefill_then_decode, tiny_delta_model
from delta_attention.modeling import few_rows_linear as few_rows, packed_linear
from delta_attention.modeling.few_rows_linear import DeltaLinear
from delta_attention.modeling.packed_linear import PACKED_ROWS, PackedWeight, packed_linear as packed_product

RELATIVE_TOLERANCE = 1e-5

def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return (actual - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max()


def packed_layer(bias=True) -> DeltaLinear:
    torch.manual_seed(0)
    layer = DeltaLinear(48, 80, bias=bias)
    layer.packed_weight = PackedWeight(layer.weight)
    return layer


@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 11, 48), (2, 3, 48), (PACKED_ROWS, 48), (1, 5, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_f_linear(shape, bias, monkeypatch):
    calls = []
    monkeypatch.setattr(few_rows, "packed_linear", lambda *args: calls.append(1) or packed_product(*args))
    layer = packed_layer(bias)
    x = torch.randn(*shape)
    if shape[-1] == 96:
        x = x[..., ::2]  # not contiguous
    with torch.no_grad():
        assert packed_linear.takes_packed(x, layer.weight)
        output = layer(x)
        assert output.shape == (*x.shape[:-1], 80)
        assert close(output, F.linear(x, layer.weight, layer.bias))
    assert calls == [1]  # through the packed copy


@pytest.mark.parametrize("case", ["too many rows", "autograd", "bfloat16", "no rows"])
def test_elsewhere_a_packed_layer_is_the_unpacked_layer_bit_for_bit(case):
    layer = packed_layer()
    unpacked = copy.deepcopy(layer)
    unpacked.__dict__.pop("packed_weight")
    rows = {"too many rows": PACKED_ROWS + 1, "no rows": 0}.get(case, 3)
    x = torch.randn(1, rows, 48)
    if case == "bfloat16":
        layer, unpacked, x = layer.bfloat16(), unpacked.bfloat16(), x.bfloat16()
    with torch.set_grad_enabled(case == "autograd"):
        assert not packed_linear.takes_packed(x, layer.weight)
        assert torch.equal(layer(x), unpacked(x))


def test_a_changed_weight_is_packed_again():
    layer = packed_layer()
    first = layer.packed_weight
    x = torch.randn(1, 4, 48)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # in place: the version counter moves
        assert not first.is_current(layer.weight)
        assert close(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.packed_weight is not first and layer.packed_weight.is_current(layer.weight)
        layer.load_state_dict({"weight": torch.randn(80, 48), "bias": torch.zeros(80)})
        assert close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_packed_model_decodes_and_verifies_as_the_unpacked_one():
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).eval()
    reference = copy.deepcopy(model)
    sizes = [m.weight.numel() * 4 for m in model.modules() if isinstance(m, DeltaLinear)]
    threshold = sorted(sizes)[len(sizes) // 2]
    added = model.pack_linear_weights(min_bytes=threshold)
    packed = [m for m in model.modules() if "packed_weight" in m.__dict__]
    assert added == sum(s for s in sizes if s >= threshold) and len(packed) == sum(s >= threshold for s in sizes)
    assert model.state_dict().keys() == reference.state_dict().keys()  # nothing of it reaches a checkpoint
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        full, stepped, _ = prefill_then_decode(model, ids, prefill=9)
        expected_full, expected_stepped, _ = prefill_then_decode(reference, ids, prefill=9)
        cache = model(ids[:1, :9]).cache
        cache.activate_past_recording()
        verified = model(ids[:1, 9:], cache=cache).logits  # a verification of three tokens
        cache.crop(-2)
        after_crop = model(ids[:1, 10:12], cache=cache).logits
    assert close(full, expected_full) and close(stepped, expected_stepped)
    assert close(verified, expected_full[:1, 9:]) and close(after_crop, expected_full[:1, 10:12])
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids[:1, :6], **greedy), reference.generate(ids[:1, :6], **greedy))
    assert torch.equal(model.generate(ids[:1, :6], prompt_lookup_num_tokens=3, **greedy),
                       reference.generate(ids[:1, :6], **greedy))
    copied = copy.deepcopy(model)  # a copy packs its own weights at first use
    with torch.no_grad():
        assert close(copied(ids).logits, expected_full)
    model.unpack_linear_weights()
    assert not any("packed_weight" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_saved_packed_model_loads_as_the_unpacked_one(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_delta_model(num_hidden_layers=2).eval()
    reference = copy.deepcopy(model)
    model.pack_linear_weights(min_bytes=0)
    model.save_pretrained(tmp_path / "packed")
    reference.save_pretrained(tmp_path / "plain")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "packed")
    assert not any("packed_weight" in m.__dict__ for m in loaded.modules())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, plain[name]), name


def test_without_onednn_nothing_is_packed_and_one_line_says_so(monkeypatch, caplog):
    model = tiny_delta_model(num_hidden_layers=2).eval()
    monkeypatch.setattr(packed_linear, "packing_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=packed_linear.__name__):
        assert model.pack_linear_weights(min_bytes=0) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "this torch build has no oneDNN packed linear (torch.ops.mkldnn); the weights stay unpacked"]
    assert not any("packed_weight" in m.__dict__ for m in model.modules())


def test_the_decode_benchmark_times_packed_copies_beside_the_models():
    from delta_attention.scripts.bench_models import run_decode_benchmark, run_prefill_benchmark, with_packed_weights

    models = {"delta": tiny_delta_model(num_hidden_layers=2).eval(),
              "hybrid": tiny_delta_model(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]).eval()}
    assert list(with_packed_weights(models, log=lambda *_: None)) == ["delta", "hybrid"]  # tiny: nothing to pack
    both = with_packed_weights(models, log=lambda *_: None, min_bytes=0)
    assert list(both) == ["delta", "delta+packed", "hybrid", "hybrid+packed"]
    assert "packed_weight" not in models["delta"].lm_head.__dict__  # the copies are packed, not the models
    assert "packed_weight" in both["delta+packed"].lm_head.__dict__
    decode = run_decode_benchmark(both, [16], steps=2, log=lambda *_: None)
    labels = [row["model"] for row in decode["rows"]]
    assert labels == ["one delta layer", "delta", "delta+packed", "hybrid", "hybrid+StaticCache", "hybrid+packed"]
    prefill = run_prefill_benchmark(both, [8], log=lambda *_: None)
    assert [row["model"] for row in prefill["rows"]] == ["delta", "hybrid"]


def test_the_decode_benchmark_lets_the_models_take_turns(monkeypatch):
    """One step of each model in turn (after one untimed step each), so a slow spell falls on every row alike."""
    from delta_attention.scripts import bench_models

    calls = []
    original = bench_models.decode_step_times

    def recorded(model, cache, token, steps, warmup=1):
        calls.append((names[id(model)], steps))
        return original(model, cache, token, steps, warmup)

    models = {"delta": tiny_delta_model(num_hidden_layers=2).eval(),
              "hybrid": tiny_delta_model(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"]).eval()}
    names = {id(model): name for name, model in models.items()}
    monkeypatch.setattr(bench_models, "decode_step_times", recorded)
    decode = bench_models.run_decode_benchmark(models, [16], steps=6, log=lambda *_: None)
    assert calls == [("delta", 0), ("hybrid", 0), ("hybrid", 0)] + [("delta", 1), ("hybrid", 1), ("hybrid", 1)] * 6
    assert [r["model"] for r in decode["rows"]] == ["one delta layer", "delta", "hybrid", "hybrid+StaticCache"]
