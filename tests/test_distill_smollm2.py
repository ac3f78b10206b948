"""The real SmolLM2-135M-Instruct (from the offline GGUF): a few steps of both stages lower held-out perplexity,
and the result reloads without the package installed."""

import json

import pytest
import torch

from delta_attention.conversion.converter.pipeline import ConversionSettings, convert
from delta_attention.conversion.training.distill import DistillOptions, run_distill
from delta_attention.conversion.training.lora import LoraOptions
from delta_attention.conversion.data.text import DataOptions
from delta_attention.conversion.training.loop import TrainingOptions
from isolated import load_isolated


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "hybrid"
    settings = ConversionSettings(keep_attention="0,8,16,24", init="copy", calibration_tokens=1024,
                                  calibration_seq_len=256, dtype="float32")
    convert(str(smollm2_gguf), out=out, settings=settings, progress=False, log=lambda *a: None)
    return out


def test_a_few_steps_of_each_stage_lower_heldout_perplexity(converted, smollm2_gguf, tmp_path):
    distill = DistillOptions(student=str(converted), output_dir=str(tmp_path / "run"), stage1_tokens=4 * 2 * 128,
                             stage2_tokens=3 * 2 * 128, stage1_lr=1e-2, stage2_lr=3e-4,
                             eval_tokens=2 * 256, eval_seq_len=256)
    results = run_distill(distill, DataOptions(dataset="builtin:train", seq_len=128),
                          TrainingOptions(batch_size=2), LoraOptions(lora_r=8))
    print(json.dumps({k: v for k, v in results.items() if k != "recipe"}, indent=1))
    assert results["teacher_ppl"] < results["converted_ppl"]
    assert results["stage1"]["heldout_ppl"] < results["converted_ppl"]
    assert results["stage2"]["heldout_ppl"] < results["converted_ppl"]

    # the distilled model reloads in a process where delta_attention cannot be imported
    model_dir = tmp_path / "run" / "model"
    ids = [[1, 504, 3458, 314, 260, 1345, 28, 378]]
    isolated = load_isolated(model_dir, ids, tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        assert torch.equal(isolated["logits"], model(torch.tensor(ids)).logits)
