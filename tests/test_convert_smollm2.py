"""Converting the real SmolLM2-135M-Instruct GGUF (fetched by `delta-attention assets`; these tests fail without it).

Short calibration and evaluation budgets keep this module at about two minutes on two cores; the full-size
figures (8k held-out tokens, 4k calibration tokens) come from the commands in the README.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import delta_attention  # noqa: F401  (registers the Auto classes)
from delta_attention.conversion import ConversionSettings, convert, convert_model
from delta_attention.conversion.data.assets import heldout_texts, train_texts
from delta_attention.conversion.converter.pipeline import plan_layers, rank_layers_by_bypass
from delta_attention.conversion.converter.sources import load_source
from delta_attention.conversion.data.windows import token_windows
from delta_attention.conversion.evaluation.perplexity import perplexity

pytestmark = pytest.mark.slow

SEQ = 256
FAST = dict(calibration_seq_len=SEQ, calibration_tokens=2048, search_windows=2, bf16=True)


@pytest.fixture(scope="module")
def teacher(smollm2_gguf):
    """The GGUF loaded once (de-quantized to float32, about 20 s and 1.1 GB)."""
    return load_source(str(smollm2_gguf))


@pytest.fixture(scope="module")
def heldout(teacher):
    return token_windows(teacher.tokenizer, heldout_texts(), SEQ, 8)


@pytest.fixture(scope="module")
def teacher_ppl(teacher, heldout):
    return perplexity(teacher.model, heldout, bf16=True)


def test_keeping_every_layer_matches_the_gguf_model(teacher):
    result = convert_model(teacher, ConversionSettings(keep_attention="all", **FAST), progress=False)
    ids = token_windows(teacher.tokenizer, train_texts()[:3], 64, 2)
    with torch.no_grad():
        diff = (result.model(ids).logits - teacher.model(ids).logits).abs().max().item()
    assert result.model.config.num_hidden_layers == 30 and result.model.config.tie_word_embeddings
    assert diff <= 1e-4


def test_calibrated_init_beats_copy_init_before_training(teacher, heldout, teacher_ppl):
    results = {}
    for init in ("copy", "calibrated"):
        converted = convert_model(teacher, ConversionSettings(keep_attention="0.25", init=init, **FAST), progress=False)
        assert converted.plan.kept == [0, 3, 7, 11, 15, 18, 22, 26]
        results[init] = perplexity(converted.model, heldout, bf16=True)
        del converted
    print(f"\nheld-out perplexity ({heldout.numel()} tokens), hybrid 8/30 softmax, before training: "
          f"teacher {teacher_ppl:.2f}, copy init {results['copy']:.2f}, calibrated init {results['calibrated']:.2f}")
    assert teacher_ppl < results["calibrated"] < results["copy"]
    assert teacher_ppl < 60  # sanity of the held-out text and of the de-quantized teacher


@pytest.mark.parametrize("keep", ["0.25", "none"])
def test_hybrid_and_all_delta_save_reload_and_generate(teacher, tmp_path, keep):
    out = tmp_path / f"smollm2-{keep}"
    settings = ConversionSettings(keep_attention=keep, init="copy", dtype="bfloat16", **FAST)  # half the bytes to write
    result = convert(teacher, out, settings, progress=False, log=lambda *a: None)
    assert len(result.plan.delta) == (22 if keep == "0.25" else 30)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.dtype == torch.bfloat16
    prompt = teacher.tokenizer("The President said that", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, result.model(prompt).logits)
    generated = reloaded.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, prompt.shape[1] + 8)
    card = (out / "README.md").read_text()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in card and "cache at 1,048,576 tokens" in card
    record = json.loads((out / "conversion.json").read_text())
    assert record["source"]["kind"] == "gguf" and record["settings"]["init"] == "copy"
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_auto_plan_keeps_layer_zero_the_induction_layers_and_the_costliest_layers(teacher):
    settings = ConversionSettings(keep_attention="auto:0.25", rank_by="bypass", rank_tokens=2 * SEQ, **FAST)
    windows = token_windows(teacher.tokenizer, train_texts(), SEQ, 2)
    plan = plan_layers(teacher.config, settings, teacher.model, windows, progress=False)
    print(f"\nauto:0.25 kept {plan.kept}; induction layers {plan.induction}; ranking (layer: perplexity with its "
          f"attention bypassed, baseline {plan.baseline_perplexity:.1f}): "
          + ", ".join(f"{i}:{p:.3g}" for i, p in plan.ranking))
    assert len(plan.kept) == 8 and 0 in plan.kept
    assert len(plan.ranking) == 30
    # SmolLM2's induction heads sit in layers 17-23 (docs/design.md, "Layer plans"); 4 of the 8 slots go to them
    induction = dict(plan.induction)
    assert {17, 18} <= set(induction) <= set(range(17, 25)) and induction[18] > 0.5
    copy_layers = [i for i, _ in plan.induction[:4]]
    assert set(copy_layers) <= set(plan.kept)
    costs = dict(plan.ranking)
    others = sorted((i for i in costs if i not in (0, *copy_layers)), key=lambda i: -costs[i])
    assert set(plan.kept) == {0, *copy_layers, *others[: 8 - 1 - len(copy_layers)]}
    assert 1 in plan.kept  # bypassing layer 1 costs most of all
    assert all(costs[i] >= plan.baseline_perplexity * 0.9 for i in costs)

    bypass_only = plan_layers(teacher.config, dataclasses.replace(settings, induction_share=0.0), teacher.model,
                              windows, progress=False)
    assert bypass_only.induction is None
    assert set(bypass_only.kept) == {0, *sorted((i for i in costs if i != 0), key=lambda i: -costs[i])[:7]}


def test_conversion_ranking_frees_the_slots_of_layers_a_delta_layer_imitates(teacher):
    """`--rank_by conversion` measures what converting each layer alone costs: layer 1, whose bypass is ruinous
    (its attention matters), is still among the costliest converted (first on the three older corpora, second
    to layer 24 since Django's pages joined the text), but far less than bypassed; the plan keeps layer 0 and
    the induction layers as the default plan does, and fills the rest by conversion cost."""
    settings = ConversionSettings(keep_attention="auto:0.25", rank_by="conversion", rank_tokens=2 * SEQ, **FAST)
    windows = token_windows(teacher.tokenizer, train_texts(), SEQ, 2)
    calibration = token_windows(teacher.tokenizer, train_texts(), SEQ, FAST["calibration_tokens"] // SEQ)
    plan = plan_layers(teacher.config, settings, teacher.model, windows, progress=False, calibration=calibration)
    costs = dict(plan.ranking)
    print(f"\nauto:0.25 --rank_by conversion kept {plan.kept}; ranking (layer: perplexity with it converted alone, "
          f"baseline {plan.baseline_perplexity:.1f}): " + ", ".join(f"{i}:{p:.3g}" for i, p in plan.ranking))
    assert plan.ranked_by == "conversion" and len(costs) == 30 and len(plan.kept) == 8
    copy_layers = [i for i, _ in plan.induction[:4]]
    others = sorted((i for i in costs if i not in (0, *copy_layers)), key=lambda i: -costs[i])
    assert set(plan.kept) == {0, *copy_layers, *others[:3]}
    assert 1 in sorted(costs, key=costs.get)[-2:] and 1 in plan.kept
    _, bypass = rank_layers_by_bypass(teacher.model, windows, bf16=True, progress=False)
    assert bypass[1] > 5 * costs[1]  # zeroing layer 1's attention is ruinous; a delta layer in its place is not
    assert bypass[2] > costs[2] and 2 not in plan.kept  # layer 2 converts almost for free
    assert all(costs[i] > plan.baseline_perplexity * 0.95 for i in costs)  # none far below: a delta layer only imitates
