"""The shared training loop: deterministic resume, NaN stop, atomic safetensors checkpoints, metrics."""

import json

import pytest
import torch

from conftest import tiny_delta_model
from delta_attention.conversion.checkpoints import latest_checkpoint
from delta_attention.conversion.metrics import plot_metrics, read_metrics
from delta_attention.conversion.saving import atomic_save
from delta_attention.conversion.training import NonFiniteLossError, TrainingOptions, data_order, run_training

BLOCKS = torch.randint(3, 97, (24, 32), generator=torch.Generator().manual_seed(0))
TOKENS = 12 * 4 * 32  # 12 steps of 4 blocks


def causal_lm_loss(model, input_ids):
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss, {}


def train(folder, options, callback=None, max_tokens=TOKENS, loss=causal_lm_loss, evaluate=None):
    model = tiny_delta_model(seed=1, linear_gate="channel")
    groups = [{"params": list(model.parameters()), "lr": 3e-3}]
    result = run_training(model, loss, groups, BLOCKS, options, folder, max_tokens, seed=5, evaluate=evaluate,
                          step_callback=callback)
    return model, result


def test_data_order_is_a_pure_function_of_seed_and_position():
    full = [i for _, i in zip(range(60), data_order(24, seed=3, start=0))]
    resumed = [i for _, i in zip(range(30), data_order(24, seed=3, start=30))]
    assert resumed == full[30:]
    assert sorted(full[:24]) == list(range(24)) and full[:24] != full[24:48]


def test_killed_and_resumed_run_ends_with_the_same_weights(tmp_path):
    options = TrainingOptions(batch_size=4, gradient_accumulation_steps=2, checkpoint_every_tokens=4 * 4 * 32,
                              mixed_precision="no")
    straight, result = train(tmp_path / "straight", options)
    assert result.steps == 12

    class Killed(Exception):
        pass

    def kill_at_6(step):
        if step == 6:
            raise Killed

    with pytest.raises(Killed):
        train(tmp_path / "resumed", options, callback=kill_at_6)
    assert latest_checkpoint(tmp_path / "resumed" / "checkpoints").name == "step-0000004"
    resumed_options = TrainingOptions(**{**options.__dict__, "resume": True})
    resumed, result = train(tmp_path / "resumed", resumed_options)
    assert result.steps == 12
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        assert (a - b).abs().max() <= 1e-5, name
    # the metrics of the resumed run continue the interrupted one without duplicates
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")]
    assert steps == list(range(1, 13))
    checkpoint = latest_checkpoint(tmp_path / "resumed" / "checkpoints")
    assert {p.name for p in checkpoint.iterdir()} == {
        "trainable.safetensors", "optimizer.safetensors", "optimizer.json", "state.json"
    }


def test_a_non_finite_loss_stops_cleanly_and_keeps_the_last_good_checkpoint(tmp_path):
    calls = {"n": 0}

    def loss_that_explodes(model, input_ids):
        calls["n"] += 1
        loss = causal_lm_loss(model, input_ids)[0]
        return (loss * float("nan") if calls["n"] >= 7 else loss), {}

    options = TrainingOptions(batch_size=4, checkpoint_every_tokens=2 * 4 * 32, mixed_precision="no")
    with pytest.raises(NonFiniteLossError, match=r"the loss became nan at step 7 .*last good checkpoint is .*step-0000006"):
        train(tmp_path, options, loss=loss_that_explodes)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000006"
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, 7))
    assert not list((tmp_path / "checkpoints").glob(".partial*"))


def test_loss_falls_with_bf16_autocast_and_metrics_are_plotted(tmp_path):
    options = TrainingOptions(batch_size=4, mixed_precision="bf16", eval_every_tokens=4 * 4 * 32)
    evaluate = lambda model: {"heldout_ppl": float(torch.exp(causal_lm_loss(model, BLOCKS[:4])[0]))}  # noqa: E731
    _, result = train(tmp_path, options, evaluate=evaluate)
    records = read_metrics(result.metrics_path)
    assert records[-1]["loss"] < records[0]["loss"]
    assert [r["step"] for r in records if "heldout_ppl" in r] == [4, 8, 12]
    assert {"tokens", "lr", "tokens_per_s"} <= set(records[0])
    png = plot_metrics({"run": result.metrics_path}, tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_batch_settings_are_refused(tmp_path):
    options = TrainingOptions(batch_size=6, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match=r"batch_size \(6\) must be divisible by gradient_accumulation_steps \(4\)"):
        train(tmp_path, options)


def test_atomic_save_replaces_a_folder_only_once_the_new_one_is_complete(tmp_path):
    folder = tmp_path / "model"
    atomic_save(lambda staging: (staging / "weights.txt").write_text("first"), folder)
    assert (folder / "weights.txt").read_text() == "first"

    def interrupted(staging):
        (staging / "weights.txt").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_save(interrupted, folder)
    assert (folder / "weights.txt").read_text() == "first"  # the old folder is untouched
    atomic_save(lambda staging: (staging / "weights.txt").write_text("second"), folder)
    assert (folder / "weights.txt").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging or retired folder left
