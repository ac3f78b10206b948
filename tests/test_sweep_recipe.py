"""`sweep-recipe` end to end on a tiny teacher: every variant scored, the winner by the rule, reruns reuse results."""

import dataclasses
import json
import math

import pytest

import delta_attention.scripts.sweep_recipe as sweep
from conftest import tiny_llama_teacher, tiny_tokenizer, words
from delta_attention.conversion.training.distill import DistillOptions
from delta_attention.scripts.cli import main
from delta_attention.scripts.sweep_recipe import SweepRecipeOptions, choose_winner


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny Llama teacher folder (with the tiny tokenizer) and training, held-out and cross-domain text files."""
    root = tmp_path_factory.mktemp("sweep")
    tiny_llama_teacher(num_hidden_layers=2).save_pretrained(root / "teacher")
    tiny_tokenizer().save_pretrained(root / "teacher")
    (root / "train.txt").write_text(words(6000, 2))
    (root / "eval.txt").write_text(words(1500, 3))
    (root / "cross.txt").write_text(" ".join(f"w{(i * 13) % 90}" for i in range(1500)))
    return root


def tiny_sweep(inputs, out, **overrides) -> SweepRecipeOptions:
    fields = dict(output_dir=str(out), teacher=str(inputs / "teacher"), dataset=str(inputs / "train.txt"),
                  eval_dataset=str(inputs / "eval.txt"), crossdomain_dataset=str(inputs / "cross.txt"),
                  variants="baseline,temperature-2,lora-r8", init="copy", stage1_tokens=256, stage2_tokens=256,
                  seq_len=32, batch_size=4, evaluations=1, eval_tokens=128, probe_steps=1, mixed_precision="no")
    fields.update(overrides)
    return SweepRecipeOptions(**fields)


def test_sweep_scores_every_variant_picks_by_the_rule_and_reuses_finished_ones(inputs, tmp_path, monkeypatch, capsys):
    runs = []
    original = sweep.run_variant

    def counted(folder, converted, teacher, options, name, resume=False):
        runs.append(name)
        return original(folder, converted, teacher, options, name, resume)

    monkeypatch.setattr(sweep, "run_variant", counted)
    out = tmp_path / "sweep"
    assert sweep.run(tiny_sweep(inputs, out)) == 0
    assert runs == ["baseline", "temperature-2", "lora-r8"]
    report = json.loads((out / "results.json").read_text())
    assert list(report["variants"]) == runs
    for variant in report["variants"].values():
        s = variant["scores"]
        for key in ("heldout_ppl", "crossdomain_ppl", "heldout_ratio", "crossdomain_ratio", "top1_agreement"):
            assert math.isfinite(s[key]), key
        assert s["crossdomain_ratio"] == pytest.approx(s["crossdomain_ppl"] / s["teacher_crossdomain_ppl"])
        assert (s["stage1_tokens"], s["stage2_tokens"]) == (256, 256)
        assert 0 <= s["top1_agreement"] <= 1
    assert report["variants"]["lora-r8"]["overrides"] == {"lora_r": 8, "lora_alpha": 16}
    # the LoRA override reached stage 2 (distill_in_budget passes distill options only)
    saved = json.loads((out / "variants" / "lora-r8" / "result.json").read_text())
    assert saved["results"]["stage2"]["lora"]["r"] == 8
    assert json.loads((out / "variants" / "baseline" / "result.json").read_text())["results"]["stage2"]["lora"][
        "r"] == 16
    assert saved["results"]["stage2"]["temperature"] == 1.0
    assert json.loads((out / "variants" / "temperature-2" / "result.json").read_text())["results"]["stage2"][
        "temperature"] == 2.0
    # the winner follows the rule on the recorded numbers: lowest cross-domain ratio, ties by agreement, then ratio
    ratios = {n: v["scores"]["crossdomain_ratio"] for n, v in report["variants"].items()}
    tied = [n for n in ratios if ratios[n] <= min(ratios.values()) + 0.01]
    expected = max(tied, key=lambda n: (report["variants"][n]["scores"]["top1_agreement"], -ratios[n]))
    assert report["winner"] == expected
    markdown = (out / "results.md").read_text()
    assert f"| **{expected}** |" in markdown and markdown.count("\n| ") == 4  # header + 3 variants
    assert (out / "sweep.png").stat().st_size > 0
    # a finished variant keeps its distilled model, metrics and report; its checkpoints and stage-1 model go
    run = out / "variants" / "baseline" / "run"
    assert (run / "model" / "model.safetensors").is_file() and (run / "stage2" / "metrics.jsonl").is_file()
    assert (run / "report.md").is_file()
    assert not any(run.glob("stage*/checkpoints")) and not (run / "stage1" / "model").exists()
    printed = capsys.readouterr().out
    assert f"winner: {expected}; its recipe:" in printed and "delta-attention distill STUDENT" in printed

    # a rerun with --resume reuses the finished variants: nothing trains again, nothing is rewritten
    stamps = {n: (out / "variants" / n / "result.json").stat().st_mtime_ns for n in runs}
    assert sweep.run(tiny_sweep(inputs, out, resume=True)) == 0
    assert runs == ["baseline", "temperature-2", "lora-r8"]
    assert stamps == {n: (out / "variants" / n / "result.json").stat().st_mtime_ns for n in runs}
    assert json.loads((out / "results.json").read_text())["winner"] == expected
    # a variant interrupted mid-way (no result.json) runs again from scratch
    (out / "variants" / "temperature-2" / "result.json").unlink()
    assert sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline,temperature-2")) == 0
    assert runs[3:] == ["temperature-2"]
    # a finished variant whose settings changed (another budget) runs again
    assert sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline", stage2_tokens=384)) == 0
    assert runs[4:] == ["baseline"]
    assert json.loads((out / "results.json").read_text())["variants"]["baseline"]["scores"]["stage2_tokens"] == 384
    # so does one whose recipe changed under it (a distill default the variants set)
    assert sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline", stage2_tokens=384)) == 0
    assert runs[5:] == []
    recipe = sweep.recipe_defaults()
    assert recipe["stage2_lr"] == DistillOptions().stage2_lr
    assert recipe["lora_target_modules"] == "q_proj,k_proj,v_proj,o_proj"
    monkeypatch.setattr(sweep, "recipe_defaults", lambda: {**recipe, "stage2_lr": recipe["stage2_lr"] / 10})
    assert sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline", stage2_tokens=384)) == 0
    assert runs[5:] == ["baseline"]
    assert f"stage2_lr {recipe['stage2_lr'] / 10}" in (out / "results.md").read_text()


def test_winner_rule_breaks_ties_by_agreement():
    def variant(ratio, agreement):
        return {"scores": {"crossdomain_ratio": ratio, "top1_agreement": agreement}}

    variants = {"a": variant(1.50, 0.40), "b": variant(1.505, 0.60), "c": variant(1.40, 0.10),
                "d": variant(float("nan"), 0.99)}
    assert choose_winner(variants, tie_margin=0.01) == "c"
    assert choose_winner(variants, tie_margin=0.2) == "b"  # a, b and c tied: the most agreement wins
    assert choose_winner({"a": variant(1.5, 0.4), "b": variant(1.5, 0.4)}, 0.0) == "a"


def test_unknown_variant_fails_in_one_line_before_anything_is_written(inputs, tmp_path, capsys):
    out = tmp_path / "sweep"
    code = main(["sweep-recipe", "--output_dir", str(out), "--variants", "baseline,lora-r99"])
    error = capsys.readouterr().err.strip()
    assert code == 1 and not out.exists()
    assert error.count("\n") == 0
    assert error.startswith("delta-attention sweep-recipe: error: --variants: unknown ['lora-r99']; choose from [")
    assert "'baseline'" in error and "'layers-uniform'" in error


def test_generated_variants_need_the_generated_folder(tmp_path):
    with pytest.raises(ValueError, match=r"\['data-generated-mix'\] train on teacher-generated text; pass --generated"):
        sweep.check_options(SweepRecipeOptions(output_dir=str(tmp_path / "o"), variants="data-generated-mix"))
    assert "data-generated-mix" not in sweep.check_options(SweepRecipeOptions(output_dir=str(tmp_path / "o")))


def test_the_full_grid_leaves_out_variants_that_today_s_defaults_make_the_baseline(tmp_path, monkeypatch, capsys):
    defaults = sweep.recipe_defaults()
    monkeypatch.setitem(sweep.VARIANTS, "temperature-now", {"temperature": defaults["temperature"]})
    monkeypatch.setitem(sweep.VARIANTS, "temperature-now-seed-1", {"temperature": defaults["temperature"], "seed": 1})
    assert sweep._repeats_baseline("temperature-now", defaults) == "baseline"
    assert sweep._repeats_baseline("temperature-now-seed-1", defaults) == "baseline-seed-1"
    assert sweep._repeats_baseline("gate-channel", defaults) == "baseline"  # the channel gate is convert's default
    for name in ("baseline", "baseline-seed-1", "temperature-2", "gate-scalar", "layers-uniform", "data-quote-mix"):
        assert sweep._repeats_baseline(name, defaults) is None, name
    # a training mix spelled out is the default `builtin:train` when its normalised weights are the default's
    with_data = {**defaults, "dataset": "builtin:train"}
    assert sweep._repeats_baseline("data-django-0.25-seed-1", with_data) == "baseline-seed-1"
    for name in ("data-three-corpora", "data-brown-0.7", "data-quote-mix"):
        assert sweep._repeats_baseline(name, with_data) is None, name
    monkeypatch.setitem(sweep.VARIANTS, "data-doubled", {"dataset": "builtin:train:sotu=0.525,shakespeare=0.375,"
                                                                    "brown=0.6,django=0.5"})
    assert sweep._repeats_baseline("data-doubled", with_data) == "baseline"
    assert sweep._repeats_baseline("data-doubled", {**defaults, "dataset": "corpus.txt"}) is None
    names = sweep.check_options(SweepRecipeOptions(output_dir=str(tmp_path / "o")))
    left_out = capsys.readouterr().out
    for name in ("temperature-now", "temperature-now-seed-1", "gate-channel", "gate-channel-seed-1", "data-doubled",
                 "data-django-0.25", "data-django-0.25-seed-1"):
        assert name not in names and name in left_out
    assert "data-three-corpora" in names
    assert {"baseline", "baseline-seed-1", "temperature-2", "gate-scalar"} <= set(names)
    assert "the recipe of ['baseline', 'baseline-seed-1']" in left_out
    # named, a repeat still runs (the README's commands of earlier sittings name gate-channel)
    assert sweep.check_options(SweepRecipeOptions(output_dir=str(tmp_path / "o"), variants="gate-channel")) == [
        "gate-channel"]


def test_existing_output_needs_resume_or_overwrite(inputs, tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists; pass --resume"):
        sweep.check_options(tiny_sweep(inputs, out))


def test_a_variant_may_not_change_what_every_variant_shares(tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.VARIANTS, "longer", {"stage2_tokens": 10})
    monkeypatch.setitem(sweep.VARIANTS, "typo", {"temprature": 2.0})
    for name, key in (("longer", "stage2_tokens"), ("typo", "temprature")):
        with pytest.raises(ValueError, match=rf"variant {name}: \['{key}'\] cannot be overridden"):
            sweep.check_options(SweepRecipeOptions(output_dir=str(tmp_path / "o"), variants=name))


def scored_result(options, name, ratio):
    """What a stand-in for `run_variant` returns: variant `name` scored `ratio` (cross-domain, to the teacher)."""
    return {"overrides": sweep._overrides(options, name), "results": {}, "scores": {
        "heldout_ppl": 2.0, "teacher_ppl": 1.0, "heldout_ratio": 2.0, "crossdomain_ppl": ratio,
        "teacher_crossdomain_ppl": 1.0, "crossdomain_ratio": ratio, "top1_agreement": 0.5,
        "continuation_prefix": 1.0, "stage1_tokens": 256, "stage2_tokens": 256, "wall_seconds": 1.0}}


def test_convert_option_variants_distil_their_own_conversion(inputs, tmp_path, monkeypatch, capsys):
    """`gate-scalar` and `neg-eigval` change the delta layers: each distils its own conversion with that option,
    the baseline (the channel gate, convert's default) keeps its folder, and the winner's recipe starts with that
    convert."""
    from transformers import AutoConfig

    used = {}

    def scored(folder, converted, teacher, options, name, resume=False):
        used[name] = converted
        return scored_result(options, name, {"baseline": 1.5, "gate-scalar": 1.3, "neg-eigval": 1.6}[name])

    monkeypatch.setattr(sweep, "run_variant", scored)
    out = tmp_path / "sweep"
    assert sweep.run(tiny_sweep(inputs, out, variants="baseline,gate-scalar,neg-eigval")) == 0
    converted = out / "converted"
    assert sorted(p.name for p in converted.iterdir()) == [
        "keep-auto-0.25", "keep-auto-0.25-allow_neg_eigval-True", "keep-auto-0.25-gate-scalar"]
    assert used == {"baseline": converted / "keep-auto-0.25", "gate-scalar": converted / "keep-auto-0.25-gate-scalar",
                    "neg-eigval": converted / "keep-auto-0.25-allow_neg_eigval-True"}
    configs = {name: AutoConfig.from_pretrained(folder, trust_remote_code=True) for name, folder in used.items()}
    assert [configs[n].linear_gate for n in used] == ["channel", "scalar", "channel"]
    assert [configs[n].linear_log_decay_floor for n in used] == [-3.5, None, -3.5]
    assert [configs[n].linear_allow_neg_eigval for n in used] == [False, False, True]
    assert configs["gate-scalar"].layer_types == configs["baseline"].layer_types  # the same plan
    printed = capsys.readouterr().out
    assert "winner: gate-scalar; its recipe:" in printed
    assert "delta-attention convert TEACHER --gate scalar --out STUDENT" in printed
    assert "delta-attention distill STUDENT  (the defaults)" in printed
    assert sweep.recipe_defaults()["gate"] == "channel"  # a change of convert's default is a change of recipe
    assert sweep.check_options(tiny_sweep(inputs, tmp_path / "other", variants="gate-scalar")) == ["gate-scalar"]


def test_resume_refuses_a_conversion_made_with_other_options(inputs, tmp_path, monkeypatch):
    """A sweep folder from before a convert default changed (its baseline converted with the scalar gate), or a
    channel-gate conversion without the log-decay floor, is refused on --resume before anything is written."""
    runs = []

    def scored(folder, converted, teacher, options, name, resume=False):
        runs.append(name)
        return scored_result(options, name, 1.5)

    monkeypatch.setattr(sweep, "run_variant", scored)
    out = tmp_path / "sweep"
    assert sweep.run(tiny_sweep(inputs, out, variants="baseline")) == 0
    baseline = out / "converted" / "keep-auto-0.25"
    record = json.loads((baseline / "conversion.json").read_text())
    config = json.loads((baseline / "config.json").read_text())
    assert (record["settings"]["gate"], config["linear_log_decay_floor"]) == ("channel", -3.5)
    # an old sweep's baseline: the scalar gate, no floor; its result no longer counts (the recipe changed)
    record["settings"]["gate"], config["linear_log_decay_floor"] = "scalar", None
    (baseline / "conversion.json").write_text(json.dumps(record))
    (baseline / "config.json").write_text(json.dumps(config))
    (out / "variants" / "baseline" / "result.json").unlink()
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ValueError, match=r"keep-auto-0.25 was converted with other options \(gate 'scalar' there, "
                                         r"'channel' now; log_decay_floor None there, -3.5 now\): continue this "
                                         r"sweep in a new --output_dir"):
        sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline"))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before and runs == ["baseline"]
    # the floor alone: a channel-gate conversion made before it existed
    record["settings"]["gate"] = "channel"
    (baseline / "conversion.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"\(log_decay_floor None there, -3.5 now\)"):
        sweep.run(tiny_sweep(inputs, out, resume=True, variants="baseline"))


def test_seed_variant_changes_only_the_seed_of_the_data_order(inputs, tmp_path, monkeypatch):
    """`baseline-seed-1` is the baseline on another seed (data order and LoRA init): the spread between runs."""
    options = tiny_sweep(inputs, tmp_path / "sweep", variants="baseline,baseline-seed-1")
    assert sweep.check_options(options) == ["baseline", "baseline-seed-1"]
    calls = {}

    def recorded(folder, converted, teacher, data, training, budget, lora, **distill):
        calls[folder.name] = (data, distill)
        raise StopIteration  # recorded; nothing trains

    monkeypatch.setattr(sweep, "distill_in_budget", recorded)
    for name in ("baseline", "baseline-seed-1"):
        with pytest.raises(StopIteration):
            sweep.run_variant(tmp_path / name, tmp_path / "converted", "teacher", options, name)
    (base_data, base_distill), (seed_data, seed_distill) = calls["baseline"], calls["baseline-seed-1"]
    assert (base_data.seed, seed_data.seed) == (0, 1)
    assert dataclasses.replace(seed_data, seed=0) == base_data
    assert "seed" not in seed_distill and seed_distill == base_distill


def test_a_variant_killed_mid_way_continues_from_its_checkpoint(inputs, tmp_path, monkeypatch):
    """`--resume` continues an interrupted variant from its last checkpoint, to the weights of a run never stopped."""
    import delta_attention.conversion.training.distill as pipeline
    from transformers import AutoModelForCausalLM

    original = pipeline.run_training
    steps = []

    class Killed(Exception):
        pass

    def training(kill: bool):
        def run_training(*args, **kwargs):
            if "stage 2" in kwargs["description"]:
                def step(n):
                    steps.append(n)
                    if kill and n == 3:
                        raise Killed
                kwargs["step_callback"] = step
            return original(*args, **kwargs)
        return run_training

    settings = dict(variants="baseline", stage2_tokens=512, checkpoint_every_tokens=256)  # 4 steps, 2 checkpoints
    monkeypatch.setattr(pipeline, "run_training", training(kill=False))
    assert sweep.run(tiny_sweep(inputs, tmp_path / "straight", **settings)) == 0
    monkeypatch.setattr(pipeline, "run_training", training(kill=True))
    with pytest.raises(Killed):
        sweep.run(tiny_sweep(inputs, tmp_path / "killed", **settings))
    monkeypatch.setattr(pipeline, "run_training", training(kill=False))
    steps.clear()
    assert sweep.run(tiny_sweep(inputs, tmp_path / "killed", resume=True, **settings)) == 0
    assert steps == [3, 4]  # from the step-2 checkpoint on
    saved = json.loads((tmp_path / "killed" / "variants" / "baseline" / "result.json").read_text())
    assert saved["results"]["resumed"] is True and saved["scores"]["stage2_tokens"] == 512
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / run / "variants" / "baseline" / "run" / "model")
              for run in ("straight", "killed")]
    a, b = (model.state_dict() for model in models)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name
