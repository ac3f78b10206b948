"""GQA-shared delta state in the model and the converter (`linear_state_sharing="kv_head"`, `convert --gqa_state`):
one state per KV head read by its group of query heads, with k, v, beta and decay per KV head.

A shared-state model must be exactly the per-head model whose k/v projections, beta, decay and short conv are
repeated over each group (same logits), decode like its full forward, and match the per-token reference kernel;
its cache holds Hkv states instead of H, and the memory report counts those."""

from __future__ import annotations

import json
import re

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoModelForCausalLM

import delta_attention  # noqa: F401  (registers the Auto classes)
from conftest import prefill_then_decode, tiny_delta_config, tiny_delta_model
from delta_attention.conversion import ConversionSettings, convert, convert_model
from delta_attention.conversion.converter.weight_mapping import repeat_kv_rows
from delta_attention.conversion.memory import cache_bytes, cache_figures, human_bytes
from delta_attention.modeling import DeltaCache, DeltaConfig, DeltaForCausalLM, delta_rule_reference
from delta_attention.modeling import modeling_delta
from delta_attention.scripts.cli import main as cli_main
from test_convert import COMMON, FAST, input_ids, saved_source, tiny_source

GATES = ["none", "scalar", "channel"]
HEADS, KV_HEADS, DIM, KERNEL = 4, 2, 16, 4  # the tiny configs of conftest and test_convert
GROUPS = HEADS // KV_HEADS
QUIET = dict(progress=False, log=lambda *a: None)


def shared_model(gate: str, seed: int = 0) -> DeltaForCausalLM:
    """A tiny all-delta model with a GQA-shared state, its short conv and decay parameters randomised."""
    model = tiny_delta_model(seed, linear_gate=gate, linear_state_sharing="kv_head")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.conv1d.weight.copy_(torch.randn(attn.conv1d.weight.shape, generator=generator) * 0.5)
            attn.b_proj.bias.copy_(torch.randn(attn.b_proj.bias.shape, generator=generator))
            attn.o_norm.weight.copy_(1 + 0.3 * torch.randn(attn.o_norm.weight.shape, generator=generator))
    return model


def per_head_twin(shared: DeltaForCausalLM) -> DeltaForCausalLM:
    """The one-state-per-head model computing the same function: every per-KV-head tensor of each delta layer
    (k/v rows, beta and decay parameters, the k and v channels of the short conv) repeated over its group."""
    twin = DeltaForCausalLM(tiny_delta_config(linear_gate=shared.config.linear_gate)).eval()
    state = dict(shared.state_dict())
    for i, layer in enumerate(shared.model.layers):
        attn, prefix = layer.self_attn, f"model.layers.{i}.self_attn."
        per_kv_head = ["k_proj.weight", "v_proj.weight", "b_proj.weight", "b_proj.bias"]  # rows per KV head
        if attn.gate != "none":
            per_kv_head += ["A_log", "dt_bias", "a_proj.weight" if attn.gate == "scalar" else "a_up_proj.weight"]
        for name in per_kv_head:
            state[prefix + name] = repeat_kv_rows(state[prefix + name], KV_HEADS, GROUPS)
        q, k, v = attn.conv1d.weight.split([attn.key_dim, attn.state_key_dim, attn.state_value_dim])
        state[prefix + "conv1d.weight"] = torch.cat(
            [q, repeat_kv_rows(k, KV_HEADS, GROUPS), repeat_kv_rows(v, KV_HEADS, GROUPS)])
    twin.load_state_dict(state)
    return twin


def test_config_option_defaults_to_one_state_per_head_and_round_trips(tmp_path):
    assert tiny_delta_config().linear_state_sharing == "head"
    assert tiny_delta_config().linear_num_state_heads == HEADS
    config = tiny_delta_config(linear_state_sharing="kv_head")
    assert config.linear_num_state_heads == KV_HEADS
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["linear_state_sharing"] == "kv_head"
    assert DeltaConfig.from_pretrained(tmp_path).linear_num_state_heads == KV_HEADS


def test_bad_state_sharing_values_are_refused_with_the_fix():
    with pytest.raises(StrictDataclassError, match=re.escape(
            "`linear_state_sharing` must be one of ['head', 'kv_head'] (head = one state per delta head, kv_head = "
            "one state per KV head shared by its query heads), got 'query'.")):
        tiny_delta_config(linear_state_sharing="query")
    with pytest.raises(StrictDataclassError, match=re.escape(
            "`linear_state_sharing='kv_head'` needs `linear_num_heads` (3) divisible by `num_key_value_heads` (2); "
            "change one of them or use 'head'.")):
        tiny_delta_config(linear_state_sharing="kv_head", linear_num_heads=3)


@pytest.mark.parametrize("gate", GATES)
def test_layer_shapes_and_cache_hold_one_state_per_kv_head(gate):
    model = shared_model(gate)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_state_heads) == (HEADS, KV_HEADS)
    assert attn.q_proj.out_features == HEADS * DIM and attn.o_proj.in_features == HEADS * DIM
    assert attn.k_proj.out_features == attn.v_proj.out_features == KV_HEADS * DIM
    assert attn.b_proj.out_features == KV_HEADS
    assert attn.conv1d.weight.shape[0] == HEADS * DIM + 2 * KV_HEADS * DIM
    if gate != "none":
        assert attn.A_log.shape == (KV_HEADS,) and attn.decay_at_rest().shape == (KV_HEADS,)
        assert attn.dt_bias.shape == ((KV_HEADS,) if gate == "scalar" else (KV_HEADS * DIM,))
    with torch.no_grad():
        cache = model(input_ids(length=20), use_cache=True).cache
    layer = cache.layers[0]
    assert layer.recurrent_states[0].shape == (2, KV_HEADS, DIM, DIM)
    assert layer.conv_states[0].shape == (2, HEADS * DIM + 2 * KV_HEADS * DIM, KERNEL)
    figures = cache_figures(model.config, model.config.layer_types)
    assert figures.states_per_layer == KV_HEADS
    assert cache_bytes(cache) == 2 * figures.state_bytes  # batch 2, float32: the report counts the same bytes


@pytest.mark.parametrize("gate", GATES)
def test_shared_state_equals_the_per_head_model_with_repeated_key_side(gate):
    shared = shared_model(gate)
    twin = per_head_twin(shared)
    ids = input_ids(length=45)
    with torch.no_grad():
        got, want = shared(ids).logits, twin(ids).logits
    assert twin.model.layers[0].self_attn.num_state_heads == HEADS
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("gate", GATES)
def test_shared_state_decode_matches_the_full_forward(gate):
    model = shared_model(gate)
    full, stepped, cache = prefill_then_decode(model, input_ids(length=40), 25)
    assert cache.layers[2].recurrent_states[0].shape == (2, KV_HEADS, DIM, DIM)
    assert (stepped - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("gate", GATES)
def test_shared_state_chunked_forward_matches_the_per_token_reference(monkeypatch, gate):
    model = shared_model(gate)
    ids = input_ids(length=45)  # several chunks of 16
    with torch.no_grad():
        chunked = model(ids).logits
        calls = []

        def reference(q, k, v, beta, g, initial_state=None, chunk_size=None):
            calls.append((q.shape[2], k.shape[2]))
            return delta_rule_reference(q, k, v, beta, g, initial_state=initial_state)

        monkeypatch.setattr(modeling_delta, "chunk_delta_rule", reference)
        looped = model(ids).logits
    assert calls == [(HEADS, KV_HEADS)] * 3
    assert (chunked - looped).abs().max().item() <= 1e-4


def test_gqa_state_conversion_copies_k_v_as_they_are_and_calibrates_per_kv_head():
    source = tiny_source("llama")
    result = convert_model(source, ConversionSettings(keep_attention="0", gqa_state=True, **FAST), progress=False)
    model = result.model
    assert model.config.linear_state_sharing == "kv_head"
    for i in result.plan.delta:
        src, dst = source.model.layers[i].self_attn, model.model.layers[i].self_attn
        assert torch.equal(dst.q_proj.weight, src.q_proj.weight) and torch.equal(dst.o_proj.weight, src.o_proj.weight)
        assert torch.equal(dst.k_proj.weight, src.k_proj.weight) and torch.equal(dst.v_proj.weight, src.v_proj.weight)
        info = result.calibration[i]
        assert len(info.beta) == len(info.half_life) == len(info.prior_beta) == KV_HEADS
        assert len(info.head_scale) == HEADS  # the output scale stays per query head
        assert torch.allclose(dst.beta_at_rest(), torch.tensor(info.beta), atol=1e-5)
    assert result.record()["settings"]["gqa_state"] is True
    # the same conversion without sharing: 2x the states (4 query heads on 2 KV heads), the conv's k/v channels too
    plain = convert_model(source, ConversionSettings(keep_attention="0", **FAST), progress=False)
    shared_state, plain_state = result.memory.converted_cache, plain.memory.converted_cache
    assert (shared_state.states_per_layer, plain_state.states_per_layer) == (KV_HEADS, HEADS)
    conv = lambda states: KERNEL * (HEADS * DIM + states * 2 * DIM) * 4  # noqa: E731
    assert shared_state.state_bytes == 3 * (KV_HEADS * DIM * DIM * 4 + conv(KV_HEADS))
    assert plain_state.state_bytes == 3 * (HEADS * DIM * DIM * 4 + conv(HEADS))


def test_gqa_state_conversion_is_saved_recorded_and_reloads(tmp_path):
    source_dir = saved_source(tmp_path, "llama")
    out, text = tmp_path / "shared", tmp_path / "calibration.txt"
    text.write_text(" ".join(f"w{i * 7 % 90}" for i in range(200)))  # words of the tiny tokenizer
    code = cli_main(["convert", str(source_dir), "--out", str(out), "--keep-attention", "none", "--gqa_state",
                     "--init", "copy", "--calibration_text", str(text), "--calibration_seq_len", "32",
                     "--calibration_tokens", "64", "--no_bf16", "--quiet"])
    assert code == 0
    assert json.loads((out / "config.json").read_text())["linear_state_sharing"] == "kv_head"
    assert json.loads((out / "conversion.json").read_text())["settings"]["gqa_state"] is True
    card = (out / "README.md").read_text()
    assert "one state per KV head, read by its 2 query heads" in card and "repeated over" not in card
    assert re.search(r"\| delta states per delta layer \| - \| 2 \|", card), card
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = input_ids(length=30)
    cache = DeltaCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    assert cache_bytes(cache) == 2 * 4 * (KV_HEADS * DIM * DIM * 4 + KERNEL * (HEADS + 2 * KV_HEADS) * DIM * 4)


def test_dry_run_prints_the_smaller_state(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    printed = {}
    for flags in ([], ["--gqa_state"]):
        capsys.readouterr()
        assert cli_main(["convert", str(source_dir), "--keep-attention", "none", "--dry-run", *flags]) == 0
        printed[bool(flags)] = capsys.readouterr().out
    for shared, states in ((False, HEADS), (True, KV_HEADS)):
        state = COMMON["num_hidden_layers"] * (states * DIM * DIM * 4 + KERNEL * (HEADS + 2 * states) * DIM * 4)
        assert re.search(rf"delta states per delta layer +- +{states}\n", printed[shared]), printed[shared]
        assert re.search(rf"delta state \(fixed, per sequence\) +0 B +{re.escape(human_bytes(state))}\n",
                         printed[shared]), printed[shared]
