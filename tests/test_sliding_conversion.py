"""`convert --attention-window W`: kept softmax layers become sliding-window layers, so the cache is bounded."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

import delta_attention  # noqa: F401  (registers the Auto classes)
from delta_attention.conversion import ConversionSettings, convert, convert_model
from delta_attention.conversion.memory import cache_bytes, human_bytes
from delta_attention.modeling import DeltaCache
from delta_attention.scripts.cli import main as cli_main
from test_convert import FAST, input_ids, saved_source, tiny_source

QUIET = dict(progress=False, log=lambda *a: None)


def test_keeping_every_layer_with_a_window_over_the_input_reproduces_the_source_logits():
    source = tiny_source("llama")
    ids = input_ids(length=40)
    result = convert_model(source, ConversionSettings(keep_attention="all", attention_window=40, **FAST), progress=False)
    narrow = convert_model(source, ConversionSettings(keep_attention="all", attention_window=8, **FAST), progress=False)
    with torch.no_grad():
        expected = source(ids).logits
        got = result.model(ids).logits
        windowed = narrow.model(ids).logits
    assert result.model.config.layer_types == ["sliding_attention"] * 4
    assert result.model.config.sliding_window == 40
    assert (got - expected).abs().max().item() <= 1e-4
    # a window shorter than the input changes the later positions only: the first 8 see the same tokens
    assert (windowed[:, :8] - expected[:, :8]).abs().max().item() <= 1e-4
    assert (windowed[:, 8:] - expected[:, 8:]).abs().max().item() > 1e-3


def test_a_given_window_replaces_a_sliding_sources_own():
    source = tiny_source("mistral")  # sliding window 12 in the source
    kept = convert_model(source, ConversionSettings(keep_attention="all", **FAST), progress=False)
    assert kept.model.config.sliding_window == 12 and kept.plan.sliding_window == 12
    result = convert_model(source, ConversionSettings(keep_attention="all", attention_window=30, **FAST),
                           progress=False)
    assert result.model.config.sliding_window == 30
    assert (result.plan.source_sliding_window, result.plan.sliding_window) == (12, 30)
    assert "softmax (sliding window 12)   -> softmax (sliding window 30)" in result.plan.describe()


def test_auto_plan_with_a_window_makes_the_kept_layers_sliding():
    source = tiny_source("llama")
    settings = ConversionSettings(keep_attention="auto:0.5", rank_tokens=64, attention_window=8, init="copy", **FAST)
    result = convert_model(source, settings, progress=False)
    assert 0 in result.plan.kept and len(result.plan.kept) == 2
    types = result.model.config.layer_types
    assert [types[i] for i in result.plan.kept] == ["sliding_attention"] * 2
    assert [types[i] for i in result.plan.delta] == ["linear_attention"] * 2


def expected_cache_bytes(config, batch: int) -> int:
    """Bytes a prefilled `DeltaCache` holds for `config` (float32), worked out from the config alone.

    A delta layer holds its float32 state [B, H, K, V] and the short conv's last `kernel` inputs of the q, k and v
    channels [B, H (2K + V), kernel]. A sliding layer is transformers' `DynamicSlidingWindowLayer`, which keeps the
    last `sliding_window - 1` keys and values between forward calls (the next token attends to those and itself,
    W tokens in all), so it holds 2 x [B, H_kv, W - 1, d].
    """
    width = 4
    heads, key, value = config.linear_num_heads, config.linear_key_head_dim, config.linear_value_head_dim
    delta = batch * (heads * key * value * 4 + heads * (2 * key + value) * config.linear_conv_kernel_size * width)
    sliding = 2 * batch * config.num_key_value_heads * (config.sliding_window - 1) * config.head_dim * width
    types = config.layer_types
    return types.count("linear_attention") * delta + types.count("sliding_attention") * sliding


def run_tokens(model, cache, ids: torch.Tensor, prefill: int) -> None:
    """Prefill `ids[:, :prefill]`, then decode the rest one token at a time, through `cache`."""
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)


def test_hybrid_conversion_with_a_window_has_a_bounded_cache(tmp_path):
    window, batch, n = 8, 2, 20
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "windowed"
    settings = ConversionSettings(keep_attention="0,2", attention_window=window, init="copy", **FAST)
    result = convert(str(source_dir), out, settings, **QUIET)

    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "linear_attention"] * 2
    assert config["sliding_window"] == window
    record = json.loads((out / "conversion.json").read_text())
    assert record["settings"]["attention_window"] == window and record["plan"]["sliding_window"] == window
    card = (out / "README.md").read_text()
    assert f"softmax (sliding window {window})" in card and f"--attention-window {window}" in card
    assert f"at most {human_bytes(result.memory.converted_cache.bound)}" in card

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = expected_cache_bytes(model.config, batch)
    ids = input_ids(length=4 * n, batch=batch)
    cache = DeltaCache(config=model.config)
    run_tokens(model, cache, ids[:, : n + 3], prefill=n)  # N > W prefilled, then 3 decoded tokens
    assert cache_bytes(cache) == expected
    cache = DeltaCache(config=model.config)
    run_tokens(model, cache, ids, prefill=n)  # 4N tokens in all: the same bytes
    assert cache.get_seq_length() == 4 * n
    assert cache_bytes(cache) == expected
    # the report's bound counts W tokens per sliding layer (what a StaticCache allocates), one more than kept here
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert result.memory.converted_cache.bound == (expected + 2 * batch * per_token) // batch


def test_dry_run_prints_the_cache_at_8k_128k_and_1m_tokens(tmp_path, capsys):
    source_dir = saved_source(tmp_path, "llama")
    code = cli_main(["convert", str(source_dir), "--keep-attention", "0.5", "--attention_window", "16", "--dry-run"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "layer   0: softmax (full)             -> softmax (sliding window 16)" in printed
    per_token = 2 * 2 * 16 * 4  # K and V, 2 KV heads of 16, float32
    heads, dim, kernel = 4, 16, 4
    state = 2 * (heads * dim * dim * 4 + heads * 3 * dim * kernel * 4)  # two delta layers
    for tokens in (8192, 131_072, 1_048_576):
        line = re.search(rf"cache at {tokens:,} tokens +(.+?)  +(.+)", printed)
        assert line, printed
        assert line.group(1).strip() == human_bytes(4 * per_token * tokens)
        assert line.group(2).strip() == human_bytes(state + 2 * per_token * 16)
    assert "nothing written" in printed


@pytest.mark.parametrize("window", ["0", "-3"])
def test_a_bad_window_is_a_one_line_cli_error(tmp_path, capsys, window):
    source_dir = saved_source(tmp_path, "llama")
    out = tmp_path / "never"
    capsys.readouterr()  # drop what saving the source printed
    code = cli_main(["convert", str(source_dir), "--out", str(out), "--attention-window", window])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.strip() == (f"delta-attention convert: error: --attention-window must be a whole number of tokens >= 1 "
                           f"(the keys/values each kept softmax layer attends to), got {int(window)}")
    assert not out.exists()
