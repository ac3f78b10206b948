"""`finetune` with its default LoRA dropout: a killed and resumed run ends with the weights of a straight run."""

import random

import pytest
import torch
from safetensors.torch import load_file

import delta_attention.conversion.training.finetune as finetune_module
from conftest import tiny_delta_model, tiny_tokenizer
from delta_attention.conversion.data.text import DataOptions
from delta_attention.conversion.training.finetune import FinetuneOptions, run_finetune
from delta_attention.conversion.training.loop import TrainingOptions


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny delta model with its tokenizer, and a training text."""
    root = tmp_path_factory.mktemp("finetune")
    tiny_delta_model(seed=3).save_pretrained(root / "model")
    tiny_tokenizer().save_pretrained(root / "model")
    rng = random.Random(0)
    (root / "train.txt").write_text(" ".join(f"w{rng.randrange(90)}" for _ in range(4000)))
    return root


def finetune(root, out, **training):
    """Twelve steps of four 16-token blocks, a checkpoint every four steps, default LoRA (dropout 0.05)."""
    options = FinetuneOptions(model=str(root / "model"), output_dir=str(out), max_tokens=12 * 4 * 16)
    data = DataOptions(dataset=str(root / "train.txt"), seq_len=16)
    return run_finetune(options, data, TrainingOptions(batch_size=4, mixed_precision="no",
                                                       checkpoint_every_tokens=4 * 4 * 16, **training))


def test_killed_and_resumed_finetune_with_dropout_ends_with_the_straight_runs_weights(model_folder, tmp_path,
                                                                                     monkeypatch):
    summary = finetune(model_folder, tmp_path / "straight")
    assert summary["lora"]["dropout"] == 0.05
    original = finetune_module.run_training

    class Killed(Exception):
        pass

    def killed_at_step_6(*args, **kwargs):
        def stop(step):
            if step == 6:
                raise Killed
        return original(*args, **{**kwargs, "step_callback": stop})

    monkeypatch.setattr(finetune_module, "run_training", killed_at_step_6)
    with pytest.raises(Killed):
        finetune(model_folder, tmp_path / "resumed")
    monkeypatch.setattr(finetune_module, "run_training", original)
    torch.manual_seed(1234)  # the resumed process starts with other generator states
    finetune(model_folder, tmp_path / "resumed", resume=True)
    a = load_file(tmp_path / "straight" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and a
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-6, name
