"""Distillation benchmark: SmolLM2-135M converted hybrid and all-delta, distilled within a time budget.

For each layout it converts the offline GGUF (calibrated init), measures the tokens/s of both stages and of
plain full fine-tuning of the teacher (bf16 autocast) with a few probe steps, turns the time budget into
token budgets, runs `distill` on `--dataset` (default `builtin:train`) with `--evaluations` held-out evaluations
in each stage, and reports held-out perplexity against tokens seen, with the cross-domain perplexity
(`builtin:crossdomain`) at the end of each stage beside it. Writes `results.json`, `results.md` and `distill.png`
under `--output_dir`.

`--resume` continues a benchmark in `--output_dir`: the teacher's speed (`teacher.json`) and each finished layout
(`LAYOUT/result.json`) are reused while their settings are unchanged, and an interrupted distillation continues
from its last checkpoint (`--checkpoint_every_tokens`) on the token budget it started with; a layout whose settings
changed starts afresh, `convert`'s options among them (a change of its defaults converts the layout again). An
existing folder is refused without `--resume` or `--overwrite`, which swaps the new benchmark in once it is done.

    python -m delta_attention.scripts.bench_distill --minutes_per_model 60
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from .resumable import RESULT_FILE, as_saved, conversion_options, kept, read_json, start_part, write_json

LAYOUTS = {"hybrid": "auto:0.25", "all-delta": "0"}


@dataclasses.dataclass
class BenchDistillOptions:
    output_dir: str = dataclasses.field(default="results/distill", metadata={"help": "results folder"})
    layouts: str = dataclasses.field(default="hybrid,all-delta", metadata={"help": "hybrid and/or all-delta"})
    minutes_per_model: float = dataclasses.field(default=60.0, metadata={"help": "training time per model"})
    stage1_share: float = dataclasses.field(default=0.4, metadata={"help": "share of the time spent in stage 1"})
    dataset: str = dataclasses.field(default="builtin:train", metadata={
        "help": "training text, as distill's --dataset (e.g. builtin:train@0.5+generated:OUT@0.5 mixes in "
                "generate-data's chat answers); the teacher's fine-tuning speed probe reads it too"})
    seq_len: int = dataclasses.field(default=512, metadata={"help": "training sequence length"})
    batch_size: int = dataclasses.field(default=4, metadata={"help": "blocks per step"})
    evaluations: int = dataclasses.field(default=5, metadata={"help": "held-out evaluations per stage"})
    eval_tokens: int = dataclasses.field(default=8192, metadata={"help": "held-out tokens per evaluation"})
    probe_steps: int = dataclasses.field(default=3, metadata={"help": "timed steps per speed probe"})
    packing: str = dataclasses.field(
        default="boundary", metadata={"help": "boundary (documents reset at each EOS) or plain (one run per block)"}
    )
    mixed_precision: str = dataclasses.field(
        default="auto", metadata={"help": "auto (bf16 autocast where the CPU has bf16 matmul units, else float32), "
                                          "bf16 or no (float32)"}
    )
    stage1_tokens: int = dataclasses.field(
        default=0, metadata={"help": "stage 1 token budget; 0 derives it from the time budget and the probed speed"}
    )
    stage2_tokens: int = dataclasses.field(
        default=0, metadata={"help": "stage 2 token budget; 0 derives it from the time budget and the probed speed"}
    )
    stage1_lr: float | None = dataclasses.field(default=None, metadata={
        "help": "distill's --stage1_lr (default: distill's default; set it and --stage2_lr to rerun another recipe "
                "beside the current one)"})
    stage2_lr: float | None = dataclasses.field(default=None, metadata={
        "help": "distill's --stage2_lr (default: distill's default)"})
    teacher: str | None = dataclasses.field(default=None, metadata={
        "help": "the model to convert and distill from (folder or .gguf); default: the offline SmolLM2-135M-Instruct"})
    eval_dataset: str = dataclasses.field(default="builtin:heldout", metadata={"help": "in-domain held-out text"})
    crossdomain_dataset: str = dataclasses.field(default="builtin:crossdomain", metadata={
        "help": "text of other domains (never trained on): cross-domain perplexity"})
    agreement: bool = dataclasses.field(default=True, metadata={
        "help": "measure each model's agreement with the teacher after stage 2, as distill does (--no_agreement: "
                "skip it)"})
    checkpoint_every_tokens: int = dataclasses.field(default=16_384, metadata={
        "help": "training checkpoint interval of each distillation: what --resume continues from"})
    resume: bool = dataclasses.field(default=False, metadata={
        "help": "continue the benchmark in --output_dir: finished parts are reused, an interrupted one continues"})
    overwrite: bool = dataclasses.field(default=False, metadata={
        "help": "replace an existing --output_dir (a benchmark folder) once the new benchmark is done"})


#: the `distill` options a benchmark may set, with distill's defaults where it does not
RECIPE_KEYS = ("stage1_lr", "stage2_lr")
#: options that decide a layout's distilled model (with its layer plan): a change retrains it
TRAINING_KEYS = ("teacher", "dataset", "eval_dataset", "crossdomain_dataset", "minutes_per_model", "stage1_share",
                 "stage1_tokens", "stage2_tokens", "seq_len", "batch_size", "evaluations", "eval_tokens",
                 "probe_steps", "packing", "mixed_precision", "agreement") + RECIPE_KEYS


def _probe(run, steps: int) -> float:
    """Tokens/s of `run(steps)` after one warm-up step; `run` returns the tokens it processed."""
    run(1)
    started = time.perf_counter()
    tokens = run(steps)
    return tokens / (time.perf_counter() - started)


def teacher_finetune_speed(teacher, blocks: torch.Tensor, steps: int, bf16: bool = True) -> float:
    """Tokens/s of plain full fine-tuning of the teacher (AdamW, bf16 autocast or float32), the reference."""
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=1e-6)
    state = {k: v.clone() for k, v in teacher.state_dict().items()}

    batch = blocks[:4]

    def run(n):
        for _ in range(n):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = teacher(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return n * batch.numel()

    teacher.train()
    speed = _probe(run, steps)
    teacher.load_state_dict(state)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return speed


def teacher_speed(source, data, options: BenchDistillOptions) -> float:
    """Tokens/s of full fine-tuning of the loaded teacher (`source`) on `data`'s blocks, the reference beside the
    students' speeds; the teacher is left frozen in eval mode."""
    from delta_attention.conversion.data.text import training_blocks

    blocks = training_blocks(data, source.tokenizer)
    blocks = blocks["input_ids"] if isinstance(blocks, dict) else blocks  # the speed probe needs ids only
    for p in source.model.parameters():
        p.requires_grad_(True)
    return teacher_finetune_speed(source.model, blocks, options.probe_steps, options.mixed_precision == "bf16")


def resolve_recipe(options: BenchDistillOptions) -> None:
    """Fill the unset recipe options (`RECIPE_KEYS`) with distill's defaults, so that the saved settings name the
    learning rates a model trained with and a later change of those defaults retrains it on `--resume`."""
    from delta_attention.conversion.training.distill import DistillOptions

    defaults = {field.name: field.default for field in dataclasses.fields(DistillOptions)}
    for key in RECIPE_KEYS:
        if getattr(options, key) is None:
            setattr(options, key, defaults[key])


def check_options(options: BenchDistillOptions) -> list[str]:
    """The layouts to run; one `ValueError` naming the flag for anything that cannot work (before any loading)."""
    layouts = [name.strip() for name in options.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        raise ValueError(f"--layouts {options.layouts!r}: unknown {unknown}; choose from {list(LAYOUTS)}")
    check_run_options(options)
    return layouts


def check_run_options(options: BenchDistillOptions) -> None:
    """The checks of the options every budgeted distillation benchmark shares, its output folder last (after
    everything else, so a bad flag never leaves a folder behind)."""
    from delta_attention.conversion.loading import check_model_spec
    from delta_attention.conversion.output_folder import check_output_folder
    from delta_attention.conversion.precision import check_cpu_mixed_precision

    check_cpu_mixed_precision(options.mixed_precision)
    for key in RECIPE_KEYS:
        if getattr(options, key) is not None and not getattr(options, key) > 0:
            raise ValueError(f"--{key} must be a positive learning rate, got {getattr(options, key)}")
    if options.checkpoint_every_tokens < 0:
        raise ValueError(f"--checkpoint_every_tokens must be >= 0 (0 = only at the end of each stage), "
                         f"got {options.checkpoint_every_tokens}")
    if options.teacher:
        check_model_spec(options.teacher, "teacher")
    check_output_folder(options.output_dir, overwrite=options.overwrite, resume=options.resume,
                        inputs=(options.teacher,))


def run(options: BenchDistillOptions) -> int:
    from delta_attention.conversion.data.assets import smollm2_gguf_path
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert
    from delta_attention.conversion.converter.sources import load_source
    from delta_attention.conversion.data.text import DataOptions
    from delta_attention.conversion.output_folder import open_run_folder
    from delta_attention.conversion.precision import resolve_mixed_precision
    from delta_attention.conversion.saving import write_text_atomically
    from delta_attention.conversion.training.loop import TrainingOptions

    layouts = check_options(options)
    data = DataOptions(dataset=options.dataset, seq_len=options.seq_len, packing=options.packing).validate()
    options.mixed_precision = resolve_mixed_precision(options.mixed_precision, "cpu")  # what the report records
    options.teacher = options.teacher or str(smollm2_gguf_path())  # what the settings record
    resolve_recipe(options)
    folder = open_run_folder(Path(options.output_dir), "bench-distill", overwrite=options.overwrite,
                             resume=options.resume)
    out = folder.work
    source = load_source(options.teacher, dtype=torch.float32)

    def measure_teacher() -> dict:
        speed = teacher_speed(source, data, options)
        return {"teacher_finetune_tokens_per_s": speed}

    teacher = kept(out / "teacher.json", as_saved({key: getattr(options, key) for key in (
        "teacher", "dataset", "seq_len", "packing", "probe_steps", "mixed_precision")}), measure_teacher, "teacher")
    report = {"threads": torch.get_num_threads(), "minutes_per_model": options.minutes_per_model,
              **{key: getattr(options, key) for key in RECIPE_KEYS}, "packing": options.packing,
              "mixed_precision": options.mixed_precision, "dataset": options.dataset, "seq_len": options.seq_len,
              "batch_size": options.batch_size,
              "teacher_finetune_tokens_per_s": teacher["teacher_finetune_tokens_per_s"], "models": {}}
    print(f"teacher full fine-tuning ({options.mixed_precision}): "
          f"{report['teacher_finetune_tokens_per_s']:.0f} tokens/s")
    training = TrainingOptions(batch_size=options.batch_size, mixed_precision=options.mixed_precision,
                               checkpoint_every_tokens=options.checkpoint_every_tokens)

    for layout in layouts:
        place = out / layout
        conversion = ConversionSettings(keep_attention=LAYOUTS[layout], dtype="float32")
        settings = as_saved({key: getattr(options, key) for key in TRAINING_KEYS}
                            | {"conversion": conversion_options(conversion)})
        done = read_json(place / RESULT_FILE)
        if done is not None and done["settings"] == settings:
            print(f"{layout}: reused from {layout}/{RESULT_FILE}")
        else:
            resume = start_part(place, settings)
            converted = place / "converted"
            if not converted.is_dir():
                convert(source, out=converted, settings=conversion)
            done = {"settings": settings, "results": distill_in_budget(
                place, converted, options.teacher, data, training, options, resume=resume,
                eval_dataset=options.eval_dataset, crossdomain_dataset=options.crossdomain_dataset,
                agreement=options.agreement)}
            write_json(place / RESULT_FILE, done)
        report["models"][layout] = done["results"]
        write_json(out / "results.json", report)

    write_text_atomically(out / "results.md", markdown(report))
    plot(report, out / "distill.png")
    folder.finish()
    print(markdown(report))
    return 0


def probe_speed(folder: Path, converted: Path, teacher: str, data, training, stage: int, tokens: int, lora=None,
                **distill_options) -> float:
    """Tokens/s of `stage` alone: `tokens` of it on `converted` into `folder/probe{stage}`, timed by the loop over
    the steps after the first (which compiles the KL and makes the first casts). `distill_options` are further
    `DistillOptions` fields (stage 3's block length)."""
    from delta_attention.conversion.training.distill import DistillOptions, run_distill
    from delta_attention.conversion.training.metrics import read_metrics, speed_after_first_step

    probe = folder / f"probe{stage}"
    run_distill(DistillOptions(student=str(converted), teacher=teacher, output_dir=str(probe), overwrite=True,
                               stages=str(stage), **{f"stage{stage}_tokens": tokens}, eval_tokens=0,
                               **distill_options), data, training, lora)
    return speed_after_first_step(read_metrics(probe / f"stage{stage}" / "metrics.jsonl"))


def stage_budgets(folder: Path, converted: Path, teacher: str, data, training, options: BenchDistillOptions,
                  lora=None, resume: bool = False) -> dict:
    """Stages 1 and 2's token budgets (`{"stage1_tokens", "stage2_tokens", "speeds"}`), kept in `folder/budget.json`.

    A few probe steps of each stage give its tokens/s, which turn the time budget into token budgets (no probes when
    both token budgets are given). With `resume`, a budget saved by an interrupted run is reused unprobed, so the
    continued run trains to the same token counts it started with."""
    from delta_attention.conversion.saving import write_text_atomically

    saved = folder / "budget.json"
    if resume and saved.is_file():
        budget = json.loads(saved.read_text())
        budget["speeds"] = {int(stage): speed for stage, speed in budget["speeds"].items()}
        return budget
    step_tokens = options.batch_size * options.seq_len
    speeds = {}
    for stage in () if options.stage1_tokens and options.stage2_tokens else (1, 2):
        started = time.perf_counter()
        speeds[stage] = probe_speed(folder, converted, teacher, data, training, stage,
                                    (options.probe_steps + 1) * step_tokens, lora)
        elapsed = time.perf_counter() - started
        print(f"{folder.name} stage {stage}: {speeds[stage]:.0f} tokens/s (probe {elapsed:.0f} s)")
    seconds = options.minutes_per_model * 60
    stage1_tokens = options.stage1_tokens or int(speeds[1] * seconds * options.stage1_share)
    stage2_tokens = options.stage2_tokens or int(speeds[2] * seconds * (1 - options.stage1_share))
    budget = {"stage1_tokens": max(step_tokens, stage1_tokens // step_tokens * step_tokens),
              "stage2_tokens": max(step_tokens, stage2_tokens // step_tokens * step_tokens), "speeds": speeds}
    write_text_atomically(saved, json.dumps(budget, indent=1))
    return budget


def distill_in_budget(folder: Path, converted: Path, teacher: str, data, training, options: BenchDistillOptions,
                      lora=None, resume: bool = False, **distill_options) -> dict:
    """Distill `converted` from `teacher` within `options.minutes_per_model` (or the given token budgets).

    The token budgets come from `stage_budgets`; the run writes under `folder/run` and evaluates on the held-out text
    along the way (`lora`, a `LoraOptions`, goes to the probes and the run; `distill_options`, further
    `DistillOptions` fields, to the run). With `resume`, an interrupted run in `folder/run` continues from its last
    checkpoints (`training.checkpoint_every_tokens`) on its saved budget; without it the run starts afresh.
    Returns `run_distill`'s results with the wall time (of this call), the probed speeds (empty without probes) and
    the held-out perplexity curve against tokens seen."""
    from delta_attention.conversion.training.distill import DistillOptions, run_distill
    from delta_attention.conversion.training.metrics import read_metrics

    budget = stage_budgets(folder, converted, teacher, data, training, options, lora, resume)
    continuing = resume and (folder / "run").is_dir()
    started = time.perf_counter()
    recipe = {key: getattr(options, key) for key in RECIPE_KEYS if getattr(options, key) is not None}
    distill = DistillOptions(student=str(converted), teacher=teacher, output_dir=str(folder / "run"),
                             overwrite=not continuing, stage1_tokens=budget["stage1_tokens"],
                             stage2_tokens=budget["stage2_tokens"], eval_tokens=options.eval_tokens,
                             **{**recipe, **distill_options})
    run_training_options = dataclasses.replace(training, num_evaluations=options.evaluations,  # per stage
                                               resume=continuing)
    results = run_distill(distill, data, run_training_options, lora)
    results["wall_seconds"] = time.perf_counter() - started
    results["resumed"] = continuing
    results["probe_tokens_per_s"] = budget["speeds"]
    curve = [{"stage": 0, "tokens": 0, "heldout_ppl": results["converted_ppl"]}]
    offset = 0
    for stage in (1, 2):
        for record in read_metrics(folder / "run" / f"stage{stage}" / "metrics.jsonl"):
            if "heldout_ppl" in record:
                curve.append({"stage": stage, "tokens": offset + record["tokens"],
                              "heldout_ppl": record["heldout_ppl"]})
        offset += results[f"stage{stage}"]["tokens"]
    results["curve"] = curve
    return results


def markdown(report: dict) -> str:
    lines = [f"Threads: {report['threads']}; {report['minutes_per_model']:g} min per model; sequence "
             f"{report['seq_len']}, batch {report['batch_size']}, packing {report.get('packing', 'plain')}, precision "
             f"{report.get('mixed_precision', 'bf16')}, data `{report.get('dataset', 'builtin:train')}`"
             f"{_recipe_words(report)}. Teacher full fine-tuning: "
             f"{report['teacher_finetune_tokens_per_s']:.0f} tokens/s.", "",
             "| model | teacher ppl | untrained | after stage 1 | after stage 2 | vs teacher | cross-domain: teacher | "
             "after stage 1 | after stage 2 | vs teacher | stage 1 tok/s | stage 2 tok/s | tokens (1 + 2) | wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["models"].items():
        s1, s2 = r["stage1"], r["stage2"]
        lines.append(
            f"| {name} | {r['teacher_ppl']:.2f} | {r['converted_ppl']:.1f} | {s1['heldout_ppl']:.2f} | "
            f"{s2['heldout_ppl']:.2f} | {s2['heldout_ppl'] / r['teacher_ppl']:.2f}x | {_crossdomain_cells(r)} | "
            f"{s1['tokens_per_s']:.0f} | {s2['tokens_per_s']:.0f} | {s1['tokens']:,} + {s2['tokens']:,} | "
            f"{r['wall_seconds'] / 60:.0f} min |")
    crossdomain = {r.get("crossdomain_dataset") for r in report["models"].values()} - {None}
    if crossdomain:
        lines += ["", f"Cross-domain perplexity on {', '.join(f'`{name}`' for name in sorted(crossdomain))} (corpora "
                      "of other domains and eras held out of training whole); the other perplexities on the held-out "
                      "documents of the training corpora."]
    return "\n".join(lines)


def _recipe_words(report: dict) -> str:
    """", learning rates 1e-2 (stage 1) and 3e-3 (stage 2)", or nothing for a report written before they were
    recorded."""
    if report.get("stage1_lr") is None:
        return ""
    return f", learning rates {report['stage1_lr']:g} (stage 1) and {report['stage2_lr']:g} (stage 2)"


def _crossdomain_cells(results: dict) -> str:
    """Teacher, after stage 1, after stage 2 and ratio cells of the cross-domain perplexity ("-" where not
    measured, e.g. in a report written before it was)."""
    teacher = results.get("teacher_crossdomain_ppl")
    after = [results[stage].get("crossdomain_ppl") for stage in ("stage1", "stage2")]
    if teacher is None or None in after:
        return " | ".join(["-"] * 4)
    return f"{teacher:.2f} | {after[0]:.2f} | {after[1]:.2f} | {after[1] / teacher:.2f}x"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, r in report["models"].items():
        axis.plot([c["tokens"] for c in r["curve"]], [c["heldout_ppl"] for c in r["curve"]], "o-", label=name)
    teacher = next(iter(report["models"].values()))["teacher_ppl"]
    axis.axhline(teacher, color="black", linestyle="--", label="teacher")
    axis.set(xlabel="tokens seen (stage 1 then stage 2)", ylabel="held-out perplexity", yscale="log",
             title="SmolLM2-135M distilled on 2 CPU cores")
    save_figure(figure, axis, path)


def save_figure(figure, axis, path: Path) -> None:
    """Grid, legend, tight layout, and the PNG at `path` (every benchmark plot ends so)."""
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


Options = BenchDistillOptions

if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["bench-distill", *sys.argv[1:]]))
