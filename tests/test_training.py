"""The shared training loop: deterministic resume, NaN stop, atomic safetensors checkpoints, metrics."""

import json
import os
import shutil

import pytest
import torch

from conftest import tiny_delta_model
from delta_attention.conversion.training import checkpoints
from delta_attention.conversion.training.checkpoints import latest_checkpoint, save_checkpoint
from delta_attention.conversion.training.metrics import plot_metrics, read_metrics, speed_after_first_step
from delta_attention.conversion.saving import atomic_save
from delta_attention.conversion.training.loop import NonFiniteLossError, TrainingOptions, data_order, run_training

BLOCKS = torch.randint(3, 97, (24, 32), generator=torch.Generator().manual_seed(0))
TOKENS = 12 * 4 * 32  # 12 steps of 4 blocks


def causal_lm_loss(model, input_ids):
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss, {}


def train(folder, options, callback=None, max_tokens=TOKENS, loss=causal_lm_loss, evaluate=None, blocks=BLOCKS,
          **model_overrides):
    model = tiny_delta_model(seed=1, linear_gate="channel", **model_overrides)
    groups = [{"params": list(model.parameters()), "lr": 3e-3}]
    result = run_training(model, loss, groups, blocks, options, folder, max_tokens, seed=5, evaluate=evaluate,
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
        "trainable.safetensors", "optimizer.safetensors", "optimizer.json", "state.json",
        "rng-rank0.safetensors", "rng-rank0.json",
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


# --- bad input on resume: never lose data, never leak a file, always one clear line ---

EVERY_2 = TrainingOptions(batch_size=4, checkpoint_every_tokens=2 * 4 * 32, mixed_precision="no")
RESUME = TrainingOptions(**{**EVERY_2.__dict__, "resume": True})


class Killed(Exception):
    pass


def kill_at(step):
    def callback(at):
        if at == step:
            raise Killed
    return callback


def never_called(step):
    raise AssertionError(f"a training step ran ({step}) although the run should have been refused")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 12-step run and the same run killed after step 9 (checkpoints step-6 and step-8 kept)."""
    root = tmp_path_factory.mktemp("runs")
    straight, _ = train(root / "finished", EVERY_2)
    with pytest.raises(Killed):
        train(root / "killed", EVERY_2, callback=kill_at(9))
    assert sorted(p.name for p in (root / "killed" / "checkpoints").glob("step-*")) == ["step-0000006", "step-0000008"]
    return root, {n: p.detach().clone() for n, p in straight.named_parameters()}


def copy_run(runs, name, tmp_path):
    return shutil.copytree(runs[0] / name, tmp_path / name)


def metric_steps(folder):
    return [r["step"] for r in read_metrics(folder / "metrics.jsonl")]


@pytest.mark.parametrize("damage", ["truncated trainable", "state not json", "optimizer missing"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(runs, tmp_path, capsys, damage):
    folder = copy_run(runs, "killed", tmp_path)
    step8 = folder / "checkpoints" / "step-0000008"
    problem = {"truncated trainable": "trainable.safetensors is truncated or corrupt",
               "state not json": "state.json is not valid JSON",
               "optimizer missing": "optimizer.safetensors is missing"}
    if damage == "truncated trainable":
        data = (step8 / "trainable.safetensors").read_bytes()
        (step8 / "trainable.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "state not json":
        (step8 / "state.json").write_text('{"step": 8, "tok')
    else:
        (step8 / "optimizer.safetensors").unlink()
    capsys.readouterr()
    model, result = train(folder, RESUME)
    out = capsys.readouterr().out
    assert f"--resume: step-0000008: {problem[damage]}; resuming from step-0000006 instead" in out
    assert result.steps == 12 and metric_steps(folder) == list(range(1, 13))
    for name, parameter in model.named_parameters():
        assert (parameter - runs[1][name]).abs().max() <= 1e-5, name


def test_no_usable_checkpoint_fails_clearly_and_keeps_the_metrics(runs, tmp_path):
    folder = copy_run(runs, "killed", tmp_path)
    for step in ("step-0000006", "step-0000008"):
        (folder / "checkpoints" / step / "state.json").write_text("not json")
    metrics = (folder / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"no usable checkpoint in .*checkpoints \(step-0000008: state.json is not "
                                         r"valid JSON; step-0000006: state.json is not valid JSON\); delete .* to "
                                         r"start this run over, or use a new output_dir"):
        train(folder, RESUME, callback=never_called)
    assert (folder / "metrics.jsonl").read_bytes() == metrics


def test_latest_naming_a_missing_step_falls_back_to_the_newest_complete_one(runs, tmp_path, capsys):
    folder = copy_run(runs, "killed", tmp_path)
    (folder / "checkpoints" / "latest").write_text("step-0000010")
    capsys.readouterr()
    # gradient accumulation does not change what a step is, so it may differ on resume
    _, result = train(folder, TrainingOptions(**{**RESUME.__dict__, "gradient_accumulation_steps": 2}))
    out = capsys.readouterr().out
    assert "--resume: step-0000010: the folder is missing; resuming from step-0000008 instead" in out
    assert result.steps == 12 and metric_steps(folder) == list(range(1, 13))


def test_latest_naming_a_missing_step_and_no_other_fails_without_wiping_the_metrics(runs, tmp_path):
    folder = copy_run(runs, "killed", tmp_path)
    for step in ("step-0000006", "step-0000008"):
        shutil.rmtree(folder / "checkpoints" / step)
    metrics = (folder / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"no usable checkpoint in .*\(step-0000008: the folder is missing\)"):
        train(folder, RESUME, callback=never_called)
    assert (folder / "metrics.jsonl").read_bytes() == metrics and metric_steps(folder) == list(range(1, 10))


def test_a_metrics_line_cut_short_by_the_kill_does_not_stop_the_resume(runs, tmp_path):
    folder = copy_run(runs, "killed", tmp_path)
    with (folder / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 10, "tok')
    _, result = train(folder, RESUME)
    assert result.steps == 12 and metric_steps(folder) == list(range(1, 13))


def test_resume_without_any_checkpoint_says_it_starts_fresh(tmp_path, capsys):
    _, result = train(tmp_path, RESUME, max_tokens=2 * 4 * 32)
    assert f"--resume: no checkpoint in {tmp_path / 'checkpoints'}; starting training from the beginning" \
        in capsys.readouterr().out
    assert result.steps == 2


def test_a_run_with_checkpoints_is_not_overwritten_without_resume(runs, tmp_path):
    folder = copy_run(runs, "killed", tmp_path)
    metrics = (folder / "metrics.jsonl").read_bytes()
    with pytest.raises(FileExistsError, match=r"holds checkpoints of an earlier run; resume it \(--resume\) or use a "
                                              r"new output_dir"):
        train(folder, EVERY_2, callback=never_called)
    assert (folder / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("change, message", [
    ({"options": TrainingOptions(**{**RESUME.__dict__, "batch_size": 8})},
     r"batch_size \(blocks per step\) was 4 in the interrupted run and is 8 now"),
    ({"blocks": BLOCKS[:, :16]}, r"the block length \(seq_len\) was 32 in the interrupted run and is 16 now"),
    ({"max_tokens": 2 * TOKENS},
     r"the token budget was 1536 tokens \(12 steps\) in the interrupted run and is 3072 tokens \(24 steps\) now"),
    ({"intermediate_size": 128},  # other trainable shapes, as with another LoRA rank
     r"the parameters being trained differ: \d+ parameters have other shapes, e\.g\. \S+ is \[96, 64\] in the "
     r"checkpoint and \[128, 64\] now \(another LoRA rank or model\?\)"),
])
def test_resuming_with_other_options_fails_before_any_step(runs, tmp_path, change, message):
    folder = copy_run(runs, "killed", tmp_path)
    metrics = (folder / "metrics.jsonl").read_bytes()
    kwargs = {"options": RESUME, **change}
    with pytest.raises(ValueError, match=f"cannot resume from .*step-0000008: {message}; resume with the same "
                                         "options, or start a new output_dir"):
        train(folder, kwargs.pop("options"), callback=never_called, **kwargs)
    assert (folder / "metrics.jsonl").read_bytes() == metrics


def test_resuming_a_finished_run_says_so_and_reports_its_last_loss(runs, tmp_path, capsys):
    folder = copy_run(runs, "finished", tmp_path)
    metrics = (folder / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    _, result = train(folder, RESUME, callback=never_called)
    assert "training is already complete (step 12 of 12); nothing left to train" in capsys.readouterr().out
    assert result.steps == 12 and result.final_loss == read_metrics(folder / "metrics.jsonl")[-1]["loss"]
    assert result.seconds > 0 and (folder / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize("option, value, message", [
    ("batch_size", 0, r"--batch_size must be a whole number >= 1, got 0"),
    ("gradient_accumulation_steps", 0, r"--gradient_accumulation_steps must be a whole number >= 1, got 0"),
    ("warmup_ratio", 1.0, r"--warmup_ratio must be in \[0, 1\) \(a share of the steps\), got 1.0"),
    ("warmup_ratio", -0.1, r"--warmup_ratio must be in \[0, 1\)"),
    ("checkpoint_every_tokens", -1, r"--checkpoint_every_tokens must be a whole number >= 0"),
    ("eval_every_tokens", -5, r"--eval_every_tokens must be a whole number >= 0"),
    ("num_evaluations", 1.5, r"--num_evaluations must be a whole number >= 0 \(0 = by --eval_every_tokens\)"),
    ("max_grad_norm", -1.0, r"--max_grad_norm must be >= 0 \(0 = no clipping\), got -1.0"),
    ("max_grad_norm", float("nan"), r"--max_grad_norm must be >= 0"),
    ("log_every_steps", 0, r"--log_every_steps must be a whole number >= 1, got 0"),
    ("mixed_precision", "fp32", r"--mixed_precision must be one of auto, no, bf16, fp16, got 'fp32'"),
])
def test_bad_training_options_are_refused_before_anything_is_written(tmp_path, option, value, message):
    options = TrainingOptions(**{**EVERY_2.__dict__, option: value})
    with pytest.raises(ValueError, match=message):
        options.validate()
    with pytest.raises(ValueError, match=message):
        train(tmp_path / "run", options, callback=never_called, max_tokens=4 * 32)
    assert not (tmp_path / "run").exists()
    TrainingOptions().validate()  # the defaults are valid


def test_checkpoints_and_outputs_get_the_users_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        train(tmp_path / "run", EVERY_2, max_tokens=2 * 4 * 32)
    finally:
        os.umask(previous)
    folders = [tmp_path / "run", tmp_path / "run" / "checkpoints", tmp_path / "run" / "checkpoints" / "step-0000002"]
    files = [tmp_path / "run" / "metrics.jsonl", *folders[-1].iterdir()]
    assert {oct(p.stat().st_mode & 0o777) for p in folders} == {oct(0o750)}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o640) for p in files}


def test_an_interrupted_checkpoint_write_leaves_no_partial_folder(tmp_path, monkeypatch):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(3)
    optimizer.step()
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder, 1, {"weight": weight}, optimizer, {"tokens": 1})
    (folder / ".partial-step-0000005").mkdir()  # left by a process killed while writing
    writes = {"n": 0}
    original = checkpoints.save_file

    def disk_full_on_the_second_file(*args, **kwargs):
        writes["n"] += 1
        if writes["n"] == 2:
            raise OSError(28, "No space left on device")
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoints, "save_file", disk_full_on_the_second_file)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(folder, 2, {"weight": weight}, optimizer, {"tokens": 2})
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-0000001"]
    assert latest_checkpoint(folder).name == "step-0000001"


def test_evaluations_run_without_the_training_autocast(tmp_path):
    seen = []

    def evaluate(model):
        seen.append(torch.is_autocast_enabled("cpu"))
        return {"probe": 0.0}

    options = TrainingOptions(batch_size=4, mixed_precision="bf16", eval_every_tokens=2 * 4 * 32)
    train(tmp_path / "run", options, max_tokens=4 * 4 * 32, evaluate=evaluate)
    assert seen == [False, False]


@pytest.mark.parametrize("steps, evaluations, expected", [(12, 3, [4, 8, 12]), (13, 3, [5, 10, 13]),
                                                          (10, 4, [3, 6, 9, 10]), (2, 5, [1, 2])])
def test_num_evaluations_spreads_that_many_over_a_run_of_any_length(tmp_path, steps, evaluations, expected):
    # a short and a long distill stage each get --num_evaluations, not the count --eval_every_tokens gives each
    options = TrainingOptions(batch_size=4, mixed_precision="no", num_evaluations=evaluations,
                              eval_every_tokens=4 * 32)  # overridden
    _, result = train(tmp_path, options, max_tokens=steps * 4 * 32, evaluate=lambda model: {"probe": 0.0})
    assert [e["step"] for e in result.evaluations] == expected


def test_speed_after_the_first_step_leaves_out_the_first_steps_time():
    # 2,048 tokens a step; the first step takes 20 s (a compile), the next two 10 s each: the loop's running
    # figures are 102.4, 136.5 and 153.6 tokens/s, the steady speed 4,096 tokens in 20 s
    records = [{"tokens": 2048 * k, "tokens_per_s": 2048 * k / seconds} for k, seconds in ((1, 20), (2, 30), (3, 40))]
    assert speed_after_first_step(records) == pytest.approx(204.8, rel=1e-12)
    assert speed_after_first_step(records[:1]) == pytest.approx(102.4, rel=1e-12)  # one step: its own speed
