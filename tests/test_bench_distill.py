"""The distillation benchmark's option checks and its sittings (`--resume`), and the resumable parts it shares with
the long-context benchmark and the recipe sweep (the full benchmark runs for hours)."""

import dataclasses
import json

import pytest

from conftest import Killed, scalar_gate_by_default, training_killed_at
from delta_attention.scripts.bench_distill import BenchDistillOptions, check_options
from delta_attention.scripts.resumable import kept, start_part


def tiny_bench(folders, out, **overrides) -> BenchDistillOptions:
    """The benchmark at toy sizes on the tiny teacher: all-delta only, fixed budgets of a few steps per stage."""
    (folders / "cross.txt").write_text(" ".join(f"w{(i * 13) % 90}" for i in range(1500)))
    fields = dict(output_dir=str(out), teacher=str(folders / "teacher"), dataset=str(folders / "train.txt"),
                  eval_dataset=str(folders / "eval.txt"), crossdomain_dataset=str(folders / "cross.txt"),
                  layouts="all-delta", stage1_tokens=256, stage2_tokens=768, seq_len=32, batch_size=4,
                  evaluations=1, eval_tokens=64, probe_steps=1, mixed_precision="no", checkpoint_every_tokens=256,
                  agreement=False)
    fields.update(overrides)
    return BenchDistillOptions(**fields)


@pytest.mark.parametrize("field, value, message", [
    ("layouts", "hybrid,quadratic", "--layouts 'hybrid,quadratic': unknown ['quadratic']"),
    ("layouts", " , ", "--layouts ' , ': unknown []"),
    ("checkpoint_every_tokens", -1, "--checkpoint_every_tokens must be >= 0"),
    ("mixed_precision", "fp8", "fp8"),
    ("stage1_lr", 0.0, "--stage1_lr must be a positive learning rate, got 0.0"),
    ("stage2_lr", -3e-3, "--stage2_lr must be a positive learning rate, got -0.003"),
])
def test_bad_options_fail_before_anything_is_written(field, value, message, tmp_path):
    options = BenchDistillOptions(output_dir=str(tmp_path / "bench"), **{field: value})
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_options(options)
    assert not (tmp_path / "bench").exists()


def test_resume_reuses_finished_layouts_and_continues_an_interrupted_one(folders, tmp_path, monkeypatch):
    """A benchmark spread over sittings: a finished layout is reused, a distillation killed in stage 2 continues from
    its checkpoint, and changed training settings retrain."""
    import delta_attention.conversion.training.distill as pipeline
    import delta_attention.scripts.bench_distill as bench

    trained, original_training = [], pipeline.run_training

    def counted_training(*args, **kwargs):
        trained.append(kwargs["description"])
        return original_training(*args, **kwargs)

    killed_at_step_5_of_stage_2 = training_killed_at(original_training, 2, 5)

    out = tmp_path / "bench"
    monkeypatch.setattr(pipeline, "run_training", killed_at_step_5_of_stage_2)
    with pytest.raises(Killed):
        bench.run(tiny_bench(folders, out))
    assert (out / "all-delta" / "run" / "stage2" / "checkpoints").is_dir()
    assert not (out / "all-delta" / "result.json").exists() and not (out / "results.md").exists()
    # an existing benchmark folder is neither reused nor replaced without being asked
    with pytest.raises(FileExistsError, match="pass --resume to continue that run or --overwrite"):
        check_options(tiny_bench(folders, out))

    monkeypatch.setattr(pipeline, "run_training", counted_training)
    assert bench.run(tiny_bench(folders, out, resume=True)) == 0
    assert trained == ["stage 2 (logit distillation)"]  # stage 1 was finished before the kill
    report = json.loads((out / "results.json").read_text())
    results = report["models"]["all-delta"]
    assert results["resumed"] is True and (results["stage1"]["tokens"], results["stage2"]["tokens"]) == (256, 768)
    assert report["teacher_finetune_tokens_per_s"] > 0 and (out / "results.md").is_file()
    assert (out / "distill.png").is_file()

    # resumed with nothing changed: nothing trains, the teacher's speed is not probed again
    trained.clear()
    monkeypatch.setattr(bench, "teacher_finetune_speed", lambda *args: pytest.fail("the teacher was probed again"))
    assert bench.run(tiny_bench(folders, out, resume=True)) == 0
    assert trained == []
    assert json.loads((out / "results.json").read_text()) == report

    # new training settings: the layout starts afresh
    assert bench.run(tiny_bench(folders, out, resume=True, stage2_tokens=512)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    report = json.loads((out / "results.json").read_text())
    assert report["models"]["all-delta"]["stage2"]["tokens"] == 512
    assert report["models"]["all-delta"]["stage2"]["lr"] == report["stage2_lr"] == pipeline.DistillOptions.stage2_lr

    # a change of distill's default learning rates retrains as well: the settings hold the rates a model trained with
    trained.clear()
    lr_field = next(field for field in dataclasses.fields(pipeline.DistillOptions) if field.name == "stage2_lr")
    monkeypatch.setattr(lr_field, "default", 1e-4)
    assert bench.run(tiny_bench(folders, out, resume=True, stage2_tokens=512)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    report = json.loads((out / "results.json").read_text())
    assert report["models"]["all-delta"]["stage2"]["lr"] == report["stage2_lr"] == 1e-4
    assert report["models"]["all-delta"]["stage1"]["lr"] == report["stage1_lr"] == pipeline.DistillOptions.stage1_lr

    # and a recipe given on the command line reaches distill and the report
    trained.clear()
    assert bench.run(tiny_bench(folders, out, resume=True, stage2_tokens=512, stage1_lr=3e-3, stage2_lr=3e-4)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    results = json.loads((out / "results.json").read_text())["models"]["all-delta"]
    assert (results["stage1"]["lr"], results["stage2"]["lr"]) == (3e-3, 3e-4)
    assert "learning rates 0.003 (stage 1) and 0.0003 (stage 2)" in (out / "results.md").read_text()

    # a change of convert's defaults (the gate) converts the layout again and retrains it, never reusing the model
    # or the result made the old way
    config = out / "all-delta" / "converted" / "config.json"
    assert json.loads(config.read_text())["linear_gate"] == "channel"
    trained.clear()
    scalar_gate_by_default(monkeypatch)
    assert bench.run(tiny_bench(folders, out, resume=True, stage2_tokens=512, stage1_lr=3e-3, stage2_lr=3e-4)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    assert json.loads(config.read_text())["linear_gate"] == "scalar"
    settings = json.loads((out / "all-delta" / "result.json").read_text())["settings"]["conversion"]
    assert (settings["gate"], settings["log_decay_floor"], settings["keep_attention"]) == ("scalar", None, "0")


def test_a_part_folder_the_benchmark_did_not_write_is_refused_and_left_alone(tmp_path):
    place = tmp_path / "all-delta"
    place.mkdir()
    (place / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no settings.json, so this benchmark did not write it"):
        start_part(place, {"a": 1})
    assert [p.name for p in place.iterdir()] == ["notes.txt"]


def test_a_part_continues_on_its_own_settings_and_starts_afresh_on_others(tmp_path, capsys):
    place = tmp_path / "part"
    assert start_part(place, {"a": 1}) is False  # new
    (place / "run").mkdir()
    assert start_part(place, {"a": 1}) is True and (place / "run").is_dir()  # interrupted, same settings
    assert start_part(place, {"a": 2}) is False and not (place / "run").exists()  # other settings: cleared
    assert "its settings changed since it ran; starting it afresh" in capsys.readouterr().out
    assert json.loads((place / "settings.json").read_text()) == {"a": 2}
    # a finished part of an older version (result.json, no settings.json) is the benchmark's own: replaced
    (place / "settings.json").unlink()
    (place / "result.json").write_text("{}")
    assert start_part(place, {"a": 3}) is False and not (place / "result.json").exists()
    # so is an interrupted one of such a version: a distill run folder and no settings
    (place / "settings.json").unlink()
    (place / "run").mkdir()
    (place / "run" / "delta_attention_run.json").write_text("{}")
    assert start_part(place, {"a": 4}) is False and not (place / "run").exists()


def test_kept_records_are_recomputed_only_when_their_settings_change(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"speed": float(len(calls))}

    path = tmp_path / "teacher.json"
    assert kept(path, {"steps": [1, 2]}, compute, "teacher")["speed"] == 1.0
    assert kept(path, {"steps": [1, 2]}, compute, "teacher")["speed"] == 1.0 and len(calls) == 1
    assert kept(path, {"steps": [1, 3]}, compute, "teacher")["speed"] == 2.0
    assert json.loads(path.read_text()) == {"settings": {"steps": [1, 3]}, "speed": 2.0}
