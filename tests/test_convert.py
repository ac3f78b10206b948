"""Conversion of tiny random Llama / Mistral / Qwen2 / Qwen3 checkpoints: exactness, saving, remote loading, errors."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import delta_attention  # noqa: F401  (registers the Auto classes)
from conftest import tiny_tokenizer
from isolated import load_isolated
from delta_attention.conversion import ConversionSettings, convert, convert_model
from delta_attention.conversion.converter.pipeline import (
    build_delta_model,
    every_layer_converted,
    rank_layers_by_conversion,
)
from delta_attention.conversion.data.windows import random_windows
from delta_attention.conversion.publishing.cards import conversion_card
from delta_attention.conversion.evaluation.perplexity import perplexity
from delta_attention.conversion.converter.sources import SOURCE_ATTRIBUTE
from delta_attention.conversion.converter.init_recipes import GATE_BIAS
from delta_attention.conversion.converter.weight_mapping import repeat_kv_rows
from delta_attention.conversion.converter.layer_plan import choose_auto, make_plan, parse_keep, uniform_layers
from delta_attention.scripts.cli import main as cli_main

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "llama-tied-bias": (LlamaForCausalLM, LlamaConfig, {"tie_word_embeddings": True, "attention_bias": True}),
    "mistral": (MistralForCausalLM, MistralConfig, {"sliding_window": 12}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 24}),
}

# small, fast calibration for tiny models (random token windows: the tiny models have no real tokenizer)
FAST = dict(calibration_seq_len=32, calibration_tokens=128, search_windows=2, bf16=False)


def tiny_source(family: str, seed: int = 0):
    model_class, config_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**COMMON, **extra)).eval()
    with torch.no_grad():  # random biases and norm weights, so that copying them is actually checked
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def input_ids(length: int = 40, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def listing(folder) -> set[str]:
    return set(os.listdir(folder))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_keeping_every_layer_reproduces_the_source_logits(family):
    source = tiny_source(family)
    result = convert_model(source, ConversionSettings(keep_attention="all", **FAST), progress=False)
    ids = input_ids(length=40)  # longer than Mistral's sliding window of 12
    with torch.no_grad():
        expected = source(ids).logits
        got = result.model(ids).logits
    assert result.plan.delta == []
    assert (got - expected).abs().max().item() <= 1e-4
    if family == "mistral":
        assert result.model.config.layer_types == ["sliding_attention"] * 4
        assert result.model.config.sliding_window == 12


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_delta_layers_get_copied_q_o_repeated_k_v_and_the_copy_init(family):
    source = tiny_source(family)
    plan = make_plan(["full_attention"] * 4, (0, 2), "test")
    model = build_delta_model(source, plan, ConversionSettings(**FAST))
    src, dst = source.model.layers[1].self_attn, model.model.layers[1].self_attn
    groups = COMMON["num_attention_heads"] // COMMON["num_key_value_heads"]
    head_dim = dst.key_head_dim
    assert torch.equal(dst.q_proj.weight, src.q_proj.weight)
    assert torch.equal(dst.o_proj.weight, src.o_proj.weight)
    for head in range(COMMON["num_attention_heads"]):  # query head h reads KV head h // groups
        kv = head // groups
        rows, kv_rows = slice(head * head_dim, (head + 1) * head_dim), slice(kv * head_dim, (kv + 1) * head_dim)
        assert torch.equal(dst.k_proj.weight[rows], src.k_proj.weight[kv_rows])
        assert torch.equal(dst.v_proj.weight[rows], src.v_proj.weight[kv_rows])
        if src.k_proj.bias is not None:
            assert torch.equal(dst.k_proj.bias[rows], src.k_proj.bias[kv_rows])
    assert (dst.o_proj.bias is None) == (src.o_proj.bias is None)
    if family == "qwen3":
        assert torch.equal(dst.q_norm.weight, src.q_norm.weight) and torch.equal(dst.k_norm.weight, src.k_norm.weight)
    # conv passes the current token through; the output gate starts near 1; no conv activation
    assert torch.equal(dst.conv1d.weight[..., -1], torch.ones_like(dst.conv1d.weight[..., -1]))
    assert dst.conv1d.weight[..., :-1].abs().max() == 0
    assert model.config.linear_conv_activation is None
    assert torch.allclose(dst.g_proj.bias, torch.full_like(dst.g_proj.bias, GATE_BIAS))
    assert dst.g_proj.weight.std() < 0.005
    # kept layers are exact copies
    for name, tensor in source.model.layers[2].self_attn.state_dict().items():
        assert torch.equal(model.model.layers[2].self_attn.state_dict()[name], tensor)
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, source.model.layers[1].mlp.up_proj.weight)


def test_repeat_kv_rows_matches_transformers_repeat_kv():
    from transformers.models.llama.modeling_llama import repeat_kv

    weight = torch.randn(2 * 3, 5)  # 2 KV heads of dim 3
    states = weight.view(1, 2, 3, 5).permute(0, 1, 3, 2)  # [B, KV, T=5, d=3]
    expected = repeat_kv(states, 3).permute(0, 1, 3, 2).reshape(6 * 3, 5)
    assert torch.equal(repeat_kv_rows(weight, 2, 3), expected)


def test_calibration_sets_output_norm_and_fits_head_scales():
    source = tiny_source("llama")
    copy = convert_model(source, ConversionSettings(keep_attention="0", init="copy", **FAST), progress=False)
    calibrated = convert_model(source, ConversionSettings(keep_attention="0", init="calibrated", **FAST), progress=False)
    for i in (1, 2, 3):
        assert not torch.allclose(copy.model.model.layers[i].self_attn.o_norm.weight, torch.ones(64))
        # the calibrated init can only lower the layer's error on the calibration windows (least squares)
        assert calibrated.calibration[i].error <= copy.calibration[i].error + 1e-6
        assert len(calibrated.calibration[i].beta) == 4 and len(calibrated.calibration[i].half_life) == 4
    stepped = convert_model(source, ConversionSettings(keep_attention="0", calibration_steps=20, **FAST), progress=False)
    for i in (1, 2, 3):
        info = stepped.calibration[i]
        assert len(info.losses) == 20 and info.error < info.error_before_steps


@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_every_gate_converts_and_runs(gate):
    source = tiny_source("llama")
    result = convert_model(source, ConversionSettings(keep_attention="0", gate=gate, **FAST), progress=False)
    assert result.model.config.linear_gate == gate
    assert ConversionSettings().gate == "channel"  # the default since the recipe sweep's ninth sitting
    # the channel gate gets the log-decay floor that keeps trained decays in the fast kernel's exact range
    assert result.model.config.linear_log_decay_floor == (-3.5 if gate == "channel" else None)
    with torch.no_grad():
        assert torch.isfinite(result.model(input_ids()).logits).all()


# -------------------------------------------------------------------------------------------- layer plans


def test_keep_attention_forms():
    assert parse_keep("all", 6).layers == tuple(range(6))
    assert parse_keep("none", 6).layers == ()
    assert parse_keep("0,4, 2", 6).layers == (0, 2, 4)
    assert parse_keep("5", 6).layers == (5,)
    assert parse_keep("0.25", 30).layers == uniform_layers(8, 30) == (0, 3, 7, 11, 15, 18, 22, 26)
    assert parse_keep("0.5", 4).layers == (0, 2)
    assert parse_keep("auto:0.25", 30).auto_count == 8
    for bad, message in [("0,6", "out of range"), ("-1", "out of range"), ("1.5", "[0, 1]"), ("x", "expected"),
                         ("auto:abc", "not a ratio")]:
        with pytest.raises(ValueError, match=message if message != "[0, 1]" else r"\[0, 1\]"):
            parse_keep(bad, 6)


def test_a_bare_zero_or_one_says_it_keeps_that_layer(caplog):
    """`--keep-attention 0` keeps layer 0, which is easily meant as 'none': the parse says so and names the fix."""
    with caplog.at_level(logging.WARNING, logger="delta_attention.conversion.converter.layer_plan"):
        assert parse_keep("0", 6).layers == (0,)
        assert parse_keep("1", 6).layers == (1,)
        for quiet in ("none", "0.0", "5", "0,1", [0], "all", "1.0"):
            parse_keep(quiet, 6)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "'0' keeps layer 0" in messages[0] and "pass 'none'" in messages[0]
    assert "'1' keeps layer 1" in messages[1] and "pass 'all'" in messages[1]


def test_auto_keeps_the_costliest_layers_and_layer_zero():
    costs = {0: 10.0, 1: 500.0, 2: 12.0, 3: 80.0}
    assert choose_auto(costs, 2) == (0, 1)
    assert choose_auto(costs, 2, keep_first_layer=False) == (1, 3)
    assert choose_auto(costs, 0) == ()


def test_auto_ranking_on_a_tiny_model():
    source = tiny_source("llama")
    result = convert_model(source, ConversionSettings(keep_attention="auto:0.5", rank_tokens=64, **FAST), progress=False)
    assert len(result.plan.kept) == 2 and 0 in result.plan.kept
    assert sorted(i for i, _ in result.plan.ranking) == [0, 1, 2, 3]
    costs = dict(result.plan.ranking)
    best_other = max((i for i in costs if i != 0), key=lambda i: costs[i])
    assert best_other in result.plan.kept


def test_conversion_ranking_is_the_perplexity_of_the_model_with_that_layer_converted():
    """Each cost of `rank_by="conversion"` (the source with one layer's attention swapped for its delta layer by a
    hook) equals the perplexity of a real converted model that converts that layer alone, with the same weights."""
    source = tiny_source("llama")
    settings = ConversionSettings(**FAST)
    calibration = random_windows(COMMON["vocab_size"], 32, 4, seed=3)
    windows = random_windows(COMMON["vocab_size"], 32, 2, seed=4)
    converted = every_layer_converted(source, calibration, settings, progress=False)
    baseline, costs = rank_layers_by_conversion(source, windows, converted, bf16=False, progress=False)
    assert baseline == pytest.approx(perplexity(source, windows, bf16=False), rel=1e-5)
    assert sorted(costs) == [0, 1, 2, 3]
    types = ["full_attention"] * COMMON["num_hidden_layers"]
    for i in costs:
        alone = build_delta_model(source, make_plan(types, tuple(j for j in costs if j != i), "one layer"), settings)
        alone.model.layers[i].self_attn.load_state_dict(converted.attention[i].state_dict())
        assert costs[i] == pytest.approx(perplexity(alone, windows, bf16=False), rel=1e-5), i
        assert costs[i] != pytest.approx(baseline, rel=1e-4)  # a converted layer changes the model


def test_auto_plan_ranked_by_conversion_keeps_the_costliest_conversions():
    source = tiny_source("llama")
    settings = ConversionSettings(keep_attention="auto:0.5", rank_tokens=64, **FAST)
    assert settings.rank_by == "conversion"  # the default since the recipe sweep's twelfth sitting
    result = convert_model(source, settings, progress=False)
    plan = result.plan
    assert plan.ranked_by == "conversion" and sorted(i for i, _ in plan.ranking) == [0, 1, 2, 3]
    costs = dict(plan.ranking)
    best_other = max((i for i in costs if i != 0), key=lambda i: costs[i])
    assert plan.kept == [0, best_other]
    assert "converted alone" in plan.describe() and "conversion costs most" in plan.rule
    assert result.record()["plan"]["ranked_by"] == "conversion"
    assert "each layer's attention replaced alone by its delta layer" in str(conversion_card(result))
    bypass = convert_model(source, ConversionSettings(keep_attention="auto:0.5", rank_by="bypass", rank_tokens=64,
                                                      **FAST), progress=False)
    assert bypass.plan.ranked_by == "bypass" and dict(bypass.plan.ranking) != costs
    assert "each layer's attention bypassed" in str(conversion_card(bypass))


def test_conversion_ranked_plan_keeps_the_layers_it_measured(monkeypatch):
    """With `rank_by="conversion"` every layer is converted and calibrated once: the plan's delta layers are those the
    ranking measured, not calibrated again (each layer initialised once, the same records and windows)."""
    from delta_attention.conversion.converter import pipeline

    calibrated = []
    real = pipeline.calibrate_layer
    monkeypatch.setattr(pipeline, "calibrate_layer", lambda *a, **k: calibrated.append(1) or real(*a, **k))
    source = tiny_source("llama")
    settings = ConversionSettings(keep_attention="auto:0.5", rank_by="conversion", rank_tokens=64, **FAST)
    result = convert_model(source, settings, progress=False)
    assert len(calibrated) == COMMON["num_hidden_layers"]  # every layer once (4), not 4 + the plan's 2 again
    windows = pipeline.calibration_windows(None, settings, COMMON["vocab_size"])
    converted = every_layer_converted(source, windows, settings, progress=False)
    assert result.calibration_tokens == windows.numel() and sorted(result.calibration) == result.plan.delta
    for i in result.plan.delta:
        made, expected = result.model.model.layers[i].self_attn.state_dict(), converted.attention[i].state_dict()
        for name in expected:
            torch.testing.assert_close(made[name], expected[name], rtol=0, atol=0, msg=f"layer {i} {name}")
        assert result.calibration[i].error == converted.calibration[i].error
    with pytest.raises(ValueError, match="either `windows` or `converted`"):
        convert_model(source, settings, windows=windows, converted=converted, progress=False)
    other = pipeline.random_windows(COMMON["vocab_size"], 32, 2, seed=9)  # given windows: the plan's layers use them
    calibrated.clear()
    given = convert_model(source, settings, windows=other, progress=False)
    assert len(calibrated) == COMMON["num_hidden_layers"] + len(given.plan.delta)
    assert given.calibration_tokens == other.numel()


def test_teacher_activations_stop_after_the_last_asked_layer():
    from delta_attention.conversion.converter.attention_transfer import collect_teacher_activations

    source = tiny_source("llama")
    ids = input_ids(length=24)
    expected = {}

    def keep(i):
        def hook(module, args, output):
            expected[i] = output[0].detach().clone()

        return hook

    hooks = [source.model.layers[i].self_attn.register_forward_hook(keep(i)) for i in (0, 1)]
    with torch.no_grad():
        source(ids)
    for hook in hooks:
        hook.remove()

    ran = []
    probes = [module.register_forward_hook(lambda *args, name=name: ran.append(name))
              for name, module in [("layer 2", source.model.layers[2]), ("layer 1 mlp", source.model.layers[1].mlp),
                                   ("lm_head", source.lm_head)]]
    with torch.no_grad():
        acts = collect_teacher_activations(source, ids, [1, 0], batch_size=2, progress=False)
    for probe in probes:
        probe.remove()
    assert ran == []
    for i in (0, 1):
        assert torch.allclose(acts[i].outputs, expected[i], atol=1e-6)


# -------------------------------------------------------------------------------------------- saving and loading

def saved_source(tmp_path, family: str):
    """A saved tiny source; with the tiny word-level tokenizer, except for Qwen2, whose folders Transformers
    reads with its own BPE `Qwen2Tokenizer` (so that source also covers the no-tokenizer path)."""
    folder = tmp_path / f"{family}-source"
    tiny_source(family).save_pretrained(folder)
    if family != "qwen2":
        tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_hybrid_conversion_saves_reloads_in_a_fresh_process_and_generates(tmp_path, family):
    source_dir = saved_source(tmp_path, family)
    out = tmp_path / "converted"
    result = convert(str(source_dir), out, ConversionSettings(keep_attention="0,2", **FAST), progress=False,
                     log=lambda *a: None)
    assert result.plan.delta == [1, 3]
    files = listing(out)
    assert {"config.json", "model.safetensors", "modeling_delta.py", "configuration_delta.py", "delta_rule.py",
            "generation_config.json", "README.md", "conversion.json"} <= files
    assert ("tokenizer.json" in files) == (family != "qwen2")
    assert not [p for p in listing(tmp_path) if p.startswith(".")]  # no staging folder left behind
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"][1] == "linear_attention" and config[SOURCE_ATTRIBUTE] == str(source_dir)
    card = (out / "README.md").read_text()
    assert "explicit list 0,2" in card and "KV bytes per token" in card and "`calibrated`" in card
    record = json.loads((out / "conversion.json").read_text())
    assert record["plan"]["kept"] == [0, 2] and record["source"]["model_type"] == family

    ids = input_ids(length=20)
    isolated = load_isolated(out, ids.tolist(), tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(isolated["logits"], reloaded(ids).logits)
        assert torch.allclose(reloaded(ids).logits, result.model(ids).logits, atol=1e-5)
    assert isolated["generated"].shape == (1, 14)
    assert isolated["vocab"] == (len(tiny_tokenizer()) if family != "qwen2" else 0)
    record = json.loads((out / "conversion.json").read_text())
    assert ("random token ids" in record["calibration_text"]) == (family == "qwen2")


def test_all_delta_conversion_through_the_cli(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "qwen2")
    out = tmp_path / "all-delta"
    code = cli_main(["convert", str(source_dir), "--out", str(out), "--keep-attention", "none", "--init", "copy",
                     "--calibration-seq-len", "32", "--calibration-tokens", "64", "--quiet"])
    assert code == 0
    assert "0 of 4 layers keep softmax attention" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.layer_types == ["linear_attention"] * 4
    generated = model.generate(input_ids(length=5, batch=1), max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, 11)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "planned"
    code = cli_main(["convert", str(source_dir), "--out", str(out), "--keep-attention", "0.5", "--dry-run"])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "2 of 4 layers keep softmax attention" in printed
    assert "layer   1: softmax (full)             -> delta" in printed
    assert "KV bytes per token" in printed and "delta state" in printed and "parameters" in printed
    assert "nothing written" in printed


def test_an_interrupted_save_leaves_no_folder(tmp_path, monkeypatch):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "interrupted"
    from delta_attention.conversion.publishing import cards as card

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(card, "conversion_card", boom)
    with pytest.raises(KeyboardInterrupt):
        convert(str(source_dir), out, ConversionSettings(keep_attention="0", init="copy", **FAST), progress=False,
                log=lambda *a: None)
    assert not out.exists()
    assert not [p for p in listing(tmp_path) if p.startswith(".")]


def test_overwrite_replaces_an_existing_folder(tmp_path):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "again"
    out.mkdir()
    (out / "conversion.json").write_text("{}")  # an earlier conversion (only folders this tool wrote are replaced)
    (out / "stale.txt").write_text("old")
    convert(str(source_dir), out, ConversionSettings(keep_attention="all", **FAST), overwrite=True, progress=False,
            log=lambda *a: None)
    assert "stale.txt" not in listing(out) and "model.safetensors" in listing(out)
    assert not [p for p in listing(tmp_path) if p.startswith(".")]


# -------------------------------------------------------------------------------------------- bad input


def expect_cli_error(argv, message, capsys):
    code = cli_main(["convert", *argv])
    err = capsys.readouterr().err
    assert code == 1, err
    assert message in err, err
    return err


def test_unsupported_architecture_is_a_clear_error(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97)).save_pretrained(folder)
    out = tmp_path / "never"
    err = expect_cli_error([str(folder), "--out", str(out)], "unsupported architecture 'gpt2'", capsys)
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in err
    assert not out.exists()


def test_missing_source_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "never"
    expect_cli_error([str(tmp_path / "missing.gguf"), "--out", str(out)], "GGUF file not found", capsys)
    expect_cli_error([str(tmp_path / "no" / "such" / "folder"), "--out", str(out)], "source not found", capsys)
    assert not out.exists()


def test_keep_attention_out_of_range_is_a_clear_error(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "never"
    expect_cli_error([str(source_dir), "--out", str(out), "--keep-attention", "0,4"],
                     "layer index 4 is out of range; the model has 4 layers", capsys)
    assert not out.exists()


def test_existing_output_without_overwrite_is_a_clear_error(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    expect_cli_error([str(source_dir), "--out", str(out)], "already exists; pass --overwrite", capsys)
    assert listing(out) == {"keep.txt"} and (out / "keep.txt").read_text() == "mine"
    assert not [p for p in listing(tmp_path) if p.startswith(".")]


def test_bad_option_values_are_clear_errors(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "never"
    expect_cli_error([str(source_dir), "--out", str(out), "--gate", "cubic"], "--gate must be one of", capsys)
    expect_cli_error([str(source_dir), "--out", str(out), "--init", "magic"], "--init must be one of", capsys)
    expect_cli_error([str(source_dir), "--out", str(out), "--rank_by", "entropy"], "--rank_by must be one of",
                     capsys)
    expect_cli_error([str(source_dir)], "output folder is needed", capsys)
    assert not out.exists()
