"""The constant-memory benchmark's option checks and tables (the benchmark itself runs for hours)."""

import dataclasses

import pytest

from conftest import Killed, scalar_gate_by_default, training_killed_at
from test_bench_distill import tiny_bench as tiny_distill_bench
from delta_attention.conversion.converter.layer_plan import parse_keep
from delta_attention.scripts.bench_long_context import (BenchLongContextOptions, check_options, conversion_settings,
                                                        markdown)


def _measured(perplexities, passkey, decode):
    buckets = [{"start": a, "end": b, "tokens": 1 if p else 0, "nll": None, "perplexity": p}
               for (a, b), p in zip([(0, 2048), (2048, 8192)], perplexities)]
    return {"long_ppl": {"buckets": buckets}, "passkey": passkey,
            "decode": [{"context": c, "cache_bytes": n, "ms_per_token": ms} for c, n, ms in decode]}


def test_tables_put_each_figure_in_its_column():
    report = {
        "threads": 2, "minutes_per_model": 60, "attention_window": 1024, "stage3_tokens": 0,
        "teacher_finetune_tokens_per_s": 300.0,
        "teacher": _measured([20.0, 18.0], {1024: 1.0}, [(1024, 2 ** 20, 40.0)]),
        "models": {"hybrid-sliding": {
            "teacher_ppl": 20.0, "teacher_crossdomain_ppl": 30.0,
            "stage1": {"tokens": 4096}, "stage2": {"heldout_ppl": 23.0, "crossdomain_ppl": 36.0, "tokens": 2048},
            "long_context": _measured([24.0, None], {1024: 0.5, 4096: 0.0}, [(1024, 3 * 2 ** 20, 30.0),
                                                                            (65536, 3 * 2 ** 20, 31.0)]),
        }},
    }
    lines = markdown(report).splitlines()
    assert sum(line.startswith("| model |") for line in lines) == 2
    # first table: held-out, ratio, cross-domain, then the buckets (the student never reached the second one)
    assert "| teacher | 20.00 | 1.00x | 30.00 | 20.00 | 18.00 | - |" in lines
    assert "| hybrid-sliding | 23.00 | 1.15x | 36.00 | 24.00 | - | 4,096 + 2,048 |" in lines
    assert "stage 3: 0 tokens" in lines[0]
    # with stage 3 the quality columns are the last stage's, and its tokens join the count
    model = report["models"]["hybrid-sliding"]
    model["stage3"] = {"heldout_ppl": 22.0, "crossdomain_ppl": 33.0, "tokens": 8192}
    report.update(stage3_share=0.25, stage3_seq_len=2048)
    lines = markdown(report).splitlines()
    assert "| hybrid-sliding | 22.00 | 1.10x | 33.00 | 24.00 | - | 4,096 + 2,048 + 8,192 |" in lines
    assert "25% of it in stage 3 (blocks of 2,048)" in lines[0]
    # second table: passkey per length (a length not measured is "-"), then cache / ms per token per context
    assert "| teacher | 100% | - | 1.0 MiB / 40.0 | - |" in lines
    assert "| hybrid-sliding | 50% | 0% | 3.0 MiB / 30.0 | 3.0 MiB / 31.0 |" in lines
    assert not any("@" in line for line in lines)  # no depth table from results that have no depths
    # by depth (keys as JSON reads them back); a model measured before depths were recorded gets "-"
    model["long_context"]["passkey_by_depth"] = {"1024": {"0.1": 0.0, "0.9": 1.0}, "4096": {"0.1": 0.0, "0.9": 0.0}}
    lines = markdown(report).splitlines()
    assert "| model | 1,024 @ 0.1 | 1,024 @ 0.9 | 4,096 @ 0.1 | 4,096 @ 0.9 |" in lines
    assert "| teacher | - | - | - | - |" in lines
    assert "| hybrid-sliding | 0% | 100% | 0% | 0% |" in lines


def test_whole_over_reset_table_when_the_reset_reading_ran():
    def with_reset(measured, whole, reset):
        measured["long_ppl"]["reset"] = {"window": 2048}
        for bucket, w, r in zip(measured["long_ppl"]["buckets"], whole, reset):
            bucket.update(perplexity=w, reset_perplexity=r, context_ratio=None if w is None else w / r)
        return measured

    report = {
        "threads": 2, "minutes_per_model": 20, "attention_window": 1024, "stage3_tokens": 0,
        "teacher_finetune_tokens_per_s": 100.0,
        "teacher": with_reset(_measured([20.0, 40.0], {}, []), [20.0, 40.0], [20.0, 10.0]),
        "models": {"hybrid-sliding": {
            "teacher_ppl": 20.0, "teacher_crossdomain_ppl": 30.0, "stage1": {"tokens": 1}, "stage2": {
                "heldout_ppl": 23.0, "tokens": 1},
            "long_context": with_reset(_measured([24.0, None], {}, []), [24.0, None], [24.0, None])}},
    }
    lines = markdown(report).splitlines()
    assert "| model | whole / reset 0-2048 | whole / reset 2048-8192 |" in lines
    assert "| teacher | 20.00 / 20.00 (1.00x) | 40.00 / 10.00 (4.00x) |" in lines
    assert "| hybrid-sliding | 24.00 / 24.00 (1.00x) | - |" in lines
    assert any("reset every 2,048 tokens" in line for line in lines)


@pytest.mark.parametrize("field, value, message", [
    ("variants", "hybrid,quadratic", "unknown ['quadratic']"),
    ("attention_window", 0, "--attention_window must be a positive"),
    ("long_buckets", "0,8192,2048", "--long_buckets"),
    ("passkey_depths", "0.5,2", "--passkey_depths"),
    ("decode_contexts", "1024,-1", "--decode_contexts"),
    ("passkey_lengths", "many", "--passkey_lengths"),
    ("long_max_tokens", 1, "--long_max_tokens must be at least 2"),
    ("long_piece", 0, "--long_piece must be at least 1"),
    ("long_reset_window", -2, "--long_reset_window must be 0"),
    ("stage3_share", 1.0, "--stage3_share must be at least 0 and below 1"),
    ("stage3_share", -0.1, "--stage3_share must be at least 0 and below 1"),
    ("stage3_seq_len", 1, "--stage3_seq_len must be at least 2"),
])
def test_bad_options_fail_before_any_work(field, value, message, tmp_path):
    options = BenchLongContextOptions(output_dir=str(tmp_path / "bench"), **{field: value})
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_options(options)


def test_default_options_run_all_four_variants(tmp_path):
    assert check_options(BenchLongContextOptions(output_dir=str(tmp_path / "bench"))) == ["hybrid", "hybrid-sliding", "all-delta", "all-delta-gqa"]


@pytest.mark.parametrize("name, kept", [("hybrid", None), ("hybrid-sliding", None), ("all-delta", ()),
                                        ("all-delta-gqa", ())])
def test_all_delta_variants_keep_no_softmax_layer(name, kept):
    """The all-delta variants must have a constant-size cache: no layer keeps softmax attention (SmolLM2: 30 layers);
    the hybrids rank a quarter of them (8) at conversion."""
    spec = parse_keep(conversion_settings(BenchLongContextOptions(), name)["keep_attention"], 30)
    if kept is None:
        assert spec.auto_count == 8 and not spec.layers
    else:
        assert spec.layers == kept and spec.auto_count is None


def test_synthesized_cache_fits_a_model_with_gqa_shared_state():
    """The decode benchmark's stand-in cache (variant all-delta-gqa): states of [B, KV heads, K, V]."""
    import torch

    from delta_attention import DeltaConfig, DeltaForCausalLM
    from delta_attention.scripts.bench_models import synthesized_cache

    config = DeltaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         layer_types=["linear_attention", "full_attention"], linear_state_sharing="kv_head")
    model = DeltaForCausalLM(config).eval()
    cache = synthesized_cache(model, context=16)
    assert cache.layers[0].recurrent_states[0].shape == (1, 2, 8, 8)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[3]]), cache=cache, use_cache=True)
    assert out.logits.shape == (1, 1, 64) and torch.isfinite(out.logits).all()


def test_a_stage3_share_and_fixed_stage3_tokens_are_refused_together():
    options = BenchLongContextOptions(stage3_share=0.25, stage3_tokens=4096)
    with pytest.raises(ValueError, match="give --stage3_share .* or --stage3_tokens .*, not both"):
        check_options(options)


def test_stage3_share_takes_its_part_of_the_time_budget_at_the_probed_speed(monkeypatch, tmp_path):
    from delta_attention.conversion.training import distill, metrics
    from delta_attention.scripts.bench_long_context import stage3_budget

    probes = []
    monkeypatch.setattr(distill, "run_distill", lambda options, *args: probes.append(options))
    # a first step of 100 tokens in 10 s, then 500 more in 10 s: 50 tokens/s after the first step
    monkeypatch.setattr(metrics, "read_metrics", lambda path: [{"tokens": 100, "tokens_per_s": 10.0},
                                                               {"tokens": 600, "tokens_per_s": 30.0}])
    options = BenchLongContextOptions(minutes_per_model=20, stage3_share=0.25, stage3_seq_len=2048, probe_steps=3)
    extra, rest, speed = stage3_budget(tmp_path / "hybrid", tmp_path / "converted", "teacher.gguf", None, None, options)
    # 50 tokens/s for a quarter of 20 minutes: 15,000 tokens, whole blocks of 2,048 -> 14,336
    assert speed == 50.0 and extra == {"stages": "1,2,3", "stage3_tokens": 14336, "stage3_seq_len": 2048}
    assert rest.minutes_per_model == 15 and options.minutes_per_model == 20  # stages 1 and 2 get the rest
    (probe,) = probes
    assert (probe.stages, probe.stage3_seq_len, probe.stage3_tokens, probe.eval_tokens) == ("3", 2048, 4 * 2048, 0)
    assert probe.output_dir == str(tmp_path / "hybrid" / "probe3")

    fixed = BenchLongContextOptions(minutes_per_model=20, stage3_tokens=6144)
    assert stage3_budget(tmp_path, tmp_path, "t", None, None, fixed)[:2] == (
        {"stages": "1,2,3", "stage3_tokens": 6144, "stage3_seq_len": 2048}, fixed)
    assert stage3_budget(tmp_path, tmp_path, "t", None, None, BenchLongContextOptions()) == (
        {}, BenchLongContextOptions(), None)
    assert len(probes) == 1  # no probe without a share


@pytest.mark.parametrize("stage, tokens, extra", [(1, 2 * 8 * 32, {}), (3, 2 * 64, {"stage3_seq_len": 64})])
def test_probe_speed_runs_the_stage_alone_and_returns_its_speed_after_the_first_step(folders, tmp_path, stage,
                                                                                     tokens, extra):
    """The probe shared by bench-distill's stages 1 and 2 and bench-long-context's stage 3, on the tiny teacher."""
    from delta_attention.conversion.data.text import DataOptions
    from delta_attention.conversion.training.lora import LoraOptions
    from delta_attention.conversion.training.loop import TrainingOptions
    from delta_attention.conversion.training.metrics import read_metrics
    from delta_attention.scripts.bench_distill import probe_speed

    data = DataOptions(dataset=str(folders / "train.txt"), seq_len=32)
    training = TrainingOptions(batch_size=8, mixed_precision="no")
    speed = probe_speed(tmp_path, folders / "student", str(folders / "teacher"), data, training, stage, tokens,
                        LoraOptions(lora_r=4), **extra)
    records = read_metrics(tmp_path / f"probe{stage}" / f"stage{stage}" / "metrics.jsonl")
    assert records[-1]["tokens"] == tokens and len(records) == 2
    seconds = [r["tokens"] / r["tokens_per_s"] for r in records]  # the loop's time up to each step
    assert speed == pytest.approx((tokens - records[0]["tokens"]) / (seconds[1] - seconds[0]), rel=1e-9) and speed > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"probe{stage}"]
    assert not any((tmp_path / f"probe{stage}" / f"stage{other}").exists() for other in {1, 2, 3} - {stage})


def tiny_bench(folders, out, **overrides) -> BenchLongContextOptions:
    """The benchmark at toy sizes on the tiny teacher (the distillation benchmark's toy settings): all-delta only."""
    fields = dataclasses.asdict(tiny_distill_bench(folders, out)) | dict(
        variants="all-delta", long_max_tokens=256, long_buckets="0,64,256", long_piece=64, long_reset_window=64,
        passkey_lengths="96", passkey_depths="0.5", decode_contexts="32", decode_new_tokens=2, teacher_max_context=256)
    fields.update(overrides)
    return BenchLongContextOptions(**fields)


def test_resume_reuses_finished_parts_and_continues_an_interrupted_variant(folders, tmp_path, monkeypatch):
    """A benchmark spread over sittings: each finished part is reused, a killed distillation continues from its
    last checkpoint to the weights of a run that was never stopped, changed settings redo only what they decide, and
    measurements are kept point by point."""
    import json

    import delta_attention.conversion.evaluation.long_context as long_context
    import delta_attention.conversion.evaluation.tasks as tasks
    import delta_attention.conversion.training.distill as pipeline
    import delta_attention.scripts.bench_long_context as bench
    from transformers import AutoModelForCausalLM

    measured, trained = [], []
    original_training = pipeline.run_training

    def counted(kind, function, kill_kind=None):
        def measured_point(model, *args, **kwargs):
            point = (type(model).__name__, kind, args[0] if kind == "decode" else
                     args[1][0] if kind == "passkey" else None)
            if point[:2] == kill_kind:
                raise Killed()
            measured.append(point)
            return function(model, *args, **kwargs)
        return measured_point

    originals = {kind: (module, name, getattr(module, name)) for kind, module, name in [
        ("long_ppl", long_context, "long_perplexity"), ("passkey", tasks, "passkey_grid"),
        ("decode", tasks, "decode_speed")]}

    def count_points(kill_kind=None):
        for kind, (module, name, function) in originals.items():
            monkeypatch.setattr(module, name, counted(kind, function, kill_kind))

    def counted_training(*args, **kwargs):
        trained.append(kwargs["description"])
        return original_training(*args, **kwargs)

    count_points()
    monkeypatch.setattr(pipeline, "run_training", counted_training)
    straight = tmp_path / "straight"
    assert bench.run(tiny_bench(folders, straight)) == 0
    every_point = [("long_ppl", None), ("passkey", 96), ("decode", 32)]
    assert sorted(measured, key=str) == sorted([(model, *point) for model in ("LlamaForCausalLM", "DeltaForCausalLM")
                                                for point in every_point], key=str)
    assert len(trained) == 2
    report = json.loads((straight / "results.json").read_text())
    assert report["models"]["all-delta"]["stage2"]["tokens"] == 768
    by_depth = report["models"]["all-delta"]["long_context"]["passkey_by_depth"]
    assert list(by_depth) == ["96"] and list(by_depth["96"]) == ["0.5"]
    assert report["models"]["all-delta"]["long_context"]["passkey"] == {"96": by_depth["96"]["0.5"]}
    assert "96 @ 0.5" in (straight / "results.md").read_text()
    assert (straight / "results.md").is_file() and (straight / "all-delta" / "result.json").is_file()

    # an existing benchmark folder is neither reused nor replaced without being asked
    with pytest.raises(FileExistsError, match="pass --resume to continue that run or --overwrite"):
        check_options(tiny_bench(folders, straight))
    # resumed with nothing changed: nothing trains or measures again
    measured.clear(), trained.clear()
    assert bench.run(tiny_bench(folders, straight, resume=True)) == 0
    assert measured == [] and trained == []
    # another passkey length and decode step count: only those points are measured, on the same distilled model
    assert bench.run(tiny_bench(folders, straight, resume=True, passkey_lengths="96,128", decode_new_tokens=3)) == 0
    assert sorted(measured, key=str) == sorted([(model, *point) for model in ("LlamaForCausalLM", "DeltaForCausalLM")
                                                for point in [("passkey", 128), ("decode", 32)]], key=str)
    assert trained == []
    again = json.loads((straight / "results.json").read_text())
    assert again["models"]["all-delta"]["stage2"] == report["models"]["all-delta"]["stage2"]
    assert again["models"]["all-delta"]["long_context"]["long_ppl"] == \
        report["models"]["all-delta"]["long_context"]["long_ppl"]
    assert list(again["models"]["all-delta"]["long_context"]["passkey"]) == ["96", "128"]

    # killed in stage 2 after its step-4 checkpoint, then resumed: the weights of the run never stopped
    killed_at_step_5_of_stage_2 = training_killed_at(original_training, 2, 5)

    killed = tmp_path / "killed"
    monkeypatch.setattr(pipeline, "run_training", killed_at_step_5_of_stage_2)
    with pytest.raises(Killed):
        bench.run(tiny_bench(folders, killed))
    assert (killed / "all-delta" / "run" / "stage2" / "checkpoints").is_dir()
    assert not (killed / "all-delta" / "result.json").exists()
    monkeypatch.setattr(pipeline, "run_training", counted_training)
    measured.clear(), trained.clear()
    count_points(kill_kind=("DeltaForCausalLM", "decode"))  # and killed again, in its last measurement
    with pytest.raises(Killed):
        bench.run(tiny_bench(folders, killed, resume=True))
    assert measured == [("DeltaForCausalLM", "long_ppl", None), ("DeltaForCausalLM", "passkey", 96)]  # teacher's kept
    count_points()
    measured.clear()
    assert bench.run(tiny_bench(folders, killed, resume=True)) == 0
    assert measured == [("DeltaForCausalLM", "decode", 32)]  # the two points before the kill were kept
    assert trained == ["stage 2 (logit distillation)"]  # the distillation finished before the kill is not redone
    results = json.loads((killed / "all-delta" / "result.json").read_text())["results"]
    assert results["resumed"] is True and results["stage2"]["tokens"] == 768
    a = AutoModelForCausalLM.from_pretrained(straight / "all-delta" / "run" / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(killed / "all-delta" / "run" / "model").state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name

    # new training settings: the variant starts afresh (its old folder, written by the benchmark, is replaced)
    trained.clear()
    assert bench.run(tiny_bench(folders, killed, resume=True, stage2_tokens=512)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    assert json.loads((killed / "results.json").read_text())["models"]["all-delta"]["stage2"]["tokens"] == 512

    # so does a change of convert's defaults: the variant is converted again (the gate) and retrained
    trained.clear()
    scalar_gate_by_default(monkeypatch)
    assert bench.run(tiny_bench(folders, killed, resume=True, stage2_tokens=512)) == 0
    assert trained == ["stage 1 (attention transfer)", "stage 2 (logit distillation)"]
    assert json.loads((killed / "all-delta" / "converted" / "config.json").read_text())["linear_gate"] == "scalar"


def test_a_variant_folder_the_benchmark_did_not_write_is_left_alone(folders, tmp_path):
    import delta_attention.scripts.bench_long_context as bench

    out = tmp_path / "bench"
    out.mkdir()
    (out / "delta_attention_run.json").write_text("{}")
    (out / "all-delta").mkdir()
    (out / "all-delta" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no settings.json, so this benchmark did not write it"):
        bench.run(tiny_bench(folders, out, resume=True))
    assert (out / "all-delta" / "notes.txt").read_text() == "mine"


def test_a_probed_budget_is_reused_by_resume_without_probing_again(tmp_path, monkeypatch):
    import delta_attention.scripts.bench_distill as bench_distill

    speeds = {1: 10.0, 2: 5.0}
    monkeypatch.setattr(bench_distill, "probe_speed", lambda folder, converted, teacher, data, training, stage, tokens,
                        lora=None: speeds[stage])
    options = bench_distill.BenchDistillOptions(minutes_per_model=1.0, stage1_share=0.5, seq_len=8, batch_size=2)
    budget = bench_distill.stage_budgets(tmp_path, None, None, None, None, options)
    assert (budget["stage1_tokens"], budget["stage2_tokens"]) == (288, 144)  # 10 and 5 tokens/s for 30 s each, whole steps of 16 tokens
    speeds.update({1: 1000.0, 2: 1000.0})  # a resumed sitting on a faster machine keeps the budget it started with
    assert bench_distill.stage_budgets(tmp_path, None, None, None, None, options, resume=True) == budget
    assert bench_distill.stage_budgets(tmp_path, None, None, None, None, options)["stage1_tokens"] == 30000
