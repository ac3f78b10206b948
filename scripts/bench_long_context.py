"""Constant-memory benchmark: SmolLM2-135M converted four ways, distilled in the same budget, measured at long context.

Variants (`--variants`): `hybrid` (a quarter of the layers keep full softmax attention), `hybrid-sliding` (the same
layers as sliding-window layers of `--attention_window` tokens), `all-delta`, and `all-delta-gqa` (one delta state
per KV head). Each is converted from the offline GGUF (calibrated init), distilled with `bench-distill`'s
time-budget logic (optionally with the long-context stage 3), then measured beside the teacher:

- held-out perplexity at `--seq_len` context, in-domain and cross-domain, from the distillation report;
- perplexity per position bucket over one long held-out document (`evaluate`'s `long_ppl`), read whole and in
  independent windows of `--long_reset_window` tokens (whole / reset per bucket: does the long context help?);
- passkey accuracy per prompt length (over `--passkey_depths`) and per needle depth;
- cache bytes and decode ms/token after `--decode_contexts` tokens of context (prefilled in pieces).

Writes `results.json`, `results.md` and `long_context.png` under `--output_dir`. The full settings take hours on 2
CPU cores (four 1-hour distillations; the teacher's 64k-token passes grow quadratically); `--minutes_per_model`,
`--long_max_tokens`, `--passkey_lengths` and `--decode_contexts` scale it down.

`--resume` continues a benchmark in `--output_dir` over as many sittings as it takes: the teacher's fine-tuning
speed (`teacher.json`) and each finished variant (`NAME/result.json`) are reused while their settings are unchanged;
an interrupted variant continues from its last training checkpoint (every `--checkpoint_every_tokens`) on the token
budget it started with. Measurements are kept point by point as they finish (`measurements.json`, the teacher's in
`--output_dir`, a variant's in its folder: the long document, each passkey length, each decode context), so a
resumed run, or one that asks for more lengths or contexts, measures only the points it lacks. A variant whose
training settings changed starts afresh, its points with it: its conversion settings count among them, `convert`'s
defaults included (a change of the default gate converts and trains it again). `--overwrite` replaces a finished
benchmark folder once the new one is complete.

    python -m delta_attention.scripts.bench_long_context --minutes_per_model 60
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from . import bench_distill
from .bench_distill import (BenchDistillOptions, check_run_options, distill_in_budget, probe_speed, save_figure,
                            teacher_speed)
from .benchmark import _ints
from .resumable import (RESULT_FILE, PointStore, as_saved, conversion_options, kept, read_json, start_part,
                        write_json)

VARIANTS = {  # name -> ConversionSettings fields (the attention window is filled in from the options)
    "hybrid": {"keep_attention": "auto:0.25"},
    "hybrid-sliding": {"keep_attention": "auto:0.25", "attention_window": None},
    "all-delta": {"keep_attention": "none"},  # not "0": that is a layer list, keeping layer 0's growing KV cache
    "all-delta-gqa": {"keep_attention": "none", "gqa_state": True},
}


@dataclasses.dataclass
class BenchLongContextOptions(BenchDistillOptions):
    output_dir: str = dataclasses.field(default="results/long-context", metadata={"help": "results folder"})
    variants: str = dataclasses.field(default=",".join(VARIANTS), metadata={"help": f"subset of {list(VARIANTS)}"})
    attention_window: int = dataclasses.field(default=1024, metadata={"help": "window of hybrid-sliding's layers"})
    stage3_share: float = dataclasses.field(default=0.0, metadata={
        "help": "share of --minutes_per_model spent in the long-context stage 3 (its speed probed like the other "
                "stages'; stages 1 and 2 split the rest by --stage1_share); 0 = no stage 3"})
    stage3_tokens: int = dataclasses.field(default=0, metadata={
        "help": "a fixed stage-3 token budget instead of --stage3_share (outside the time budget; 0 = none)"})
    stage3_seq_len: int = dataclasses.field(default=2048, metadata={"help": "tokens per stage-3 block"})
    long_max_tokens: int = dataclasses.field(default=65_536, metadata={"help": "length of the long document"})
    long_buckets: str = dataclasses.field(default="0,2048,8192,32768,65536", metadata={"help": "position buckets"})
    long_piece: int = dataclasses.field(default=1024, metadata={"help": "tokens per forward of the long document"})
    long_reset_window: int = dataclasses.field(default=2048, metadata={
        "help": "also read the document in independent windows of this many tokens: whole / reset perplexity per "
                "bucket (0 = off)"})
    passkey_lengths: str = dataclasses.field(default="1024,4096,16384,65536", metadata={"help": "passkey lengths"})
    passkey_depths: str = dataclasses.field(default="0.1,0.5,0.9", metadata={"help": "relative needle depths"})
    decode_contexts: str = dataclasses.field(default="1024,65536,1048576", metadata={"help": "decode contexts"})
    decode_new_tokens: int = dataclasses.field(default=8, metadata={"help": "decode steps timed per context"})
    teacher_max_context: int = dataclasses.field(
        default=65_536, metadata={"help": "skip the teacher's passkey/decode points beyond this many tokens"})
    eval_dataset: str = dataclasses.field(default="builtin:heldout", metadata={
        "help": "held-out text: the perplexity at --seq_len and the long document (its texts joined)"})


#: options that decide a variant's distilled model (with its conversion settings): a change retrains it
TRAINING_KEYS = bench_distill.TRAINING_KEYS + ("stage3_share", "stage3_tokens", "stage3_seq_len")
#: options that decide the long-document perplexity (one measurement)
LONG_PPL_KEYS = ("eval_dataset", "long_max_tokens", "long_buckets", "long_piece", "long_reset_window")
#: options that decide the long-context measurements: a change measures the points it adds or changes
MEASURE_KEYS = LONG_PPL_KEYS + ("passkey_lengths", "passkey_depths", "decode_contexts", "decode_new_tokens")
#: a model's measurements, point by point (`PointStore`): in a variant's folder, and the teacher's in the run folder
POINTS_FILE = "measurements.json"


def check_options(options: BenchLongContextOptions) -> list[str]:
    """The variants to run; one `ValueError` naming the flag for anything that cannot work (before any loading)."""
    from delta_attention.conversion.evaluation.long_context import check_long_context_options

    variants = [name.strip() for name in options.variants.split(",") if name.strip()]
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants {options.variants!r}: unknown {unknown}; choose from {list(VARIANTS)}")
    if not 0.0 <= options.stage3_share < 1.0:
        raise ValueError(f"--stage3_share must be at least 0 and below 1 (a share of --minutes_per_model), "
                         f"got {options.stage3_share}")
    if options.stage3_share and options.stage3_tokens:
        raise ValueError("give --stage3_share (a share of the time budget) or --stage3_tokens (a fixed budget), "
                         "not both")
    if options.stage3_seq_len < 2:
        raise ValueError(f"--stage3_seq_len must be at least 2, got {options.stage3_seq_len}")
    if options.attention_window < 1:
        raise ValueError(f"--attention_window must be a positive number of tokens, got {options.attention_window}")
    check_long_context_options(options)  # buckets, depths, document length and piece size, as `evaluate` checks them
    for name in ("passkey_lengths", "decode_contexts"):
        try:
            values = _ints(getattr(options, name))
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise ValueError(f"--{name} {getattr(options, name)!r} must be positive token counts, such as 1024,4096")
    check_run_options(options)
    return variants


def stage3_budget(folder: Path, converted: Path, teacher: str, data, training, options: BenchLongContextOptions,
                  resume: bool = False) -> tuple[dict, BenchLongContextOptions, float | None]:
    """Stage 3's `distill` options, the options stages 1 and 2 then run under, and stage 3's probed tokens/s.

    `--stage3_share` probes stage 3 on the converted model (a few blocks of `--stage3_seq_len`), gives it that share
    of the time budget and leaves stages 1 and 2 the rest; `--stage3_tokens` is a fixed budget beside the time
    budget; neither: no stage 3. A probed budget is kept in `folder/stage3_budget.json`, which `resume` reuses."""
    if not options.stage3_share and not options.stage3_tokens:
        return {}, options, None
    from delta_attention.conversion.saving import write_text_atomically

    tokens, speed, seq_len = options.stage3_tokens, None, options.stage3_seq_len
    if not tokens:
        saved = folder / "stage3_budget.json"
        if resume and saved.is_file():
            tokens, speed = (json.loads(saved.read_text())[key] for key in ("stage3_tokens", "speed"))
        else:
            speed = probe_speed(folder, converted, teacher, data, training, 3, (options.probe_steps + 1) * seq_len,
                                stage3_seq_len=seq_len)
            print(f"{folder.name} stage 3: {speed:.0f} tokens/s")
            tokens = max(seq_len,
                         int(speed * options.minutes_per_model * 60 * options.stage3_share) // seq_len * seq_len)
            write_text_atomically(saved, json.dumps({"stage3_tokens": tokens, "speed": speed}))
        options = dataclasses.replace(options, minutes_per_model=options.minutes_per_model * (1 - options.stage3_share))
    return {"stages": "1,2,3", "stage3_tokens": tokens, "stage3_seq_len": seq_len}, options, speed


def measure(model, tokenizer, texts: list[str], options: BenchLongContextOptions,
            max_context: int | None = None, points: PointStore | None = None) -> dict:
    """Long-document perplexity by bucket, passkey accuracy per length (and per needle depth), cache bytes and decode
    ms/token; each point (the long document, a passkey length, a decode context) taken from `points` when it was
    measured before under the same settings, and saved there as soon as it is measured."""
    from delta_attention.conversion.evaluation.long_context import long_perplexity, parse_buckets, parse_depths
    from delta_attention.conversion.evaluation.tasks import decode_speed, mean_over_depths, passkey_grid

    points = points or PointStore(None, {})
    limit = max_context or max(_ints(options.decode_contexts) + _ints(options.passkey_lengths))
    depths = parse_depths(options.passkey_depths)
    long_ppl = points.get("long_ppl", {key: getattr(options, key) for key in LONG_PPL_KEYS}, lambda: long_perplexity(
        model, tokenizer, texts, options.long_max_tokens, parse_buckets(options.long_buckets), options.long_piece,
        reset_window=options.long_reset_window))
    grid = {str(length): points.get("passkey", {"length": length, "depths": depths},
                                    lambda length=length: passkey_grid(model, tokenizer, [length], depths)[length])
            for length in _ints(options.passkey_lengths) if length <= limit}
    decode = [points.get("decode", {"context": context, "new_tokens": options.decode_new_tokens},
                         lambda context=context: decode_speed(model, context, options.decode_new_tokens))
              for context in _ints(options.decode_contexts) if context <= limit]
    return {"long_ppl": long_ppl, "passkey": mean_over_depths(grid), "passkey_by_depth": grid, "decode": decode}


def _settings(options: BenchLongContextOptions, keys: tuple[str, ...], **extra) -> dict:
    """The options `keys` (and `extra`) as they read back from JSON, so they compare equal to saved settings."""
    return as_saved({key: getattr(options, key) for key in keys} | extra)


def conversion_settings(options: BenchLongContextOptions, name: str) -> dict:
    """Variant `name`'s `ConversionSettings` fields, the attention window filled in from the options."""
    settings = dict(VARIANTS[name])
    if "attention_window" in settings:
        settings["attention_window"] = options.attention_window
    return settings


def run(options: BenchLongContextOptions) -> int:
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert
    from delta_attention.conversion.converter.sources import load_source
    from delta_attention.conversion.data.assets import smollm2_gguf_path
    from delta_attention.conversion.data.text import DataOptions, evaluation_texts
    from delta_attention.conversion.training.loop import TrainingOptions
    from delta_attention.conversion.output_folder import open_run_folder
    from delta_attention.conversion.precision import resolve_mixed_precision
    from delta_attention.conversion.saving import write_text_atomically

    variants = check_options(options)
    options.mixed_precision = resolve_mixed_precision(options.mixed_precision, "cpu")  # what the report records
    teacher = options.teacher or str(smollm2_gguf_path())
    options.teacher = teacher  # what the settings record (a resumed run must use the same teacher)
    bench_distill.resolve_recipe(options)
    folder = open_run_folder(Path(options.output_dir), "bench-long-context", overwrite=options.overwrite,
                             resume=options.resume)
    out = folder.work
    source = load_source(teacher, dtype=torch.float32)
    data = DataOptions(dataset=options.dataset, seq_len=options.seq_len, packing=options.packing)
    texts = [text for group in evaluation_texts(options.eval_dataset) for text in group]
    report = {"threads": torch.get_num_threads(), "minutes_per_model": options.minutes_per_model,
              "attention_window": options.attention_window, "stage3_tokens": options.stage3_tokens,
              "stage3_share": options.stage3_share, "stage3_seq_len": options.stage3_seq_len,
              **{key: getattr(options, key) for key in bench_distill.RECIPE_KEYS}, "models": {}}

    speed = kept(out / "teacher.json", _settings(options, ("teacher", "dataset", "probe_steps", "mixed_precision")),
                 lambda: {"teacher_finetune_tokens_per_s": teacher_speed(source, data, options)}, "teacher")
    report["teacher_finetune_tokens_per_s"] = speed["teacher_finetune_tokens_per_s"]
    with torch.no_grad():  # each point measured once: a resumed run measures only what is new
        report["teacher"] = measure(source.model.eval(), source.tokenizer, texts, options, options.teacher_max_context,
                                    PointStore(out / POINTS_FILE, {"teacher": teacher}))
    training = TrainingOptions(batch_size=options.batch_size, mixed_precision=options.mixed_precision,
                               checkpoint_every_tokens=options.checkpoint_every_tokens)

    for name in variants:
        place = out / name
        conversion = ConversionSettings(dtype="float32", **conversion_settings(options, name))
        training_settings = _settings(options, TRAINING_KEYS, conversion=conversion_options(conversion))
        measure_settings = _settings(options, MEASURE_KEYS)
        done = read_json(place / RESULT_FILE)
        if done is not None and done["training_settings"] == training_settings:
            results = done["results"]
            if done["measure_settings"] == measure_settings:
                print(f"{name}: reused from {name}/{RESULT_FILE}")
            else:
                print(f"{name}: measuring its distilled model (points measured before are reused)")
                results["long_context"] = measure_variant(place, texts, options, training_settings)
        else:
            resume = start_part(place, training_settings)
            converted = place / "converted"
            if not converted.is_dir():
                convert(source, out=converted, settings=conversion)
            extra, budget_options, stage3_speed = stage3_budget(place, converted, teacher, data, training, options,
                                                                resume)
            results = distill_in_budget(place, converted, teacher, data, training, budget_options, resume=resume,
                                        eval_dataset=options.eval_dataset,
                                        crossdomain_dataset=options.crossdomain_dataset, agreement=options.agreement,
                                        **extra)
            results["stage3_probe_tokens_per_s"] = stage3_speed
            # trained: a run killed while measuring keeps the distilled model and goes on measuring
            write_json(place / RESULT_FILE,
                       {"training_settings": training_settings, "measure_settings": None, "results": results})
            results["long_context"] = measure_variant(place, texts, options, training_settings)
        write_json(place / RESULT_FILE,
                   {"training_settings": training_settings, "measure_settings": measure_settings, "results": results})
        report["models"][name] = results
        write_json(out / "results.json", report)

    write_text_atomically(out / "results.md", markdown(report))
    plot(report, out / "long_context.png")
    folder.finish()
    print(markdown(report))
    return 0


def measure_variant(place: Path, texts: list[str], options: BenchLongContextOptions, training_settings: dict) -> dict:
    """`measure` of the distilled model in `place/run/model` (float32, no grad), its points kept in `place`."""
    from delta_attention.conversion.loading import load_model

    model, tokenizer = load_model(str(place / "run" / "model"))
    with torch.no_grad():
        return measure(model.float().eval(), tokenizer, texts, options,
                       points=PointStore(place / POINTS_FILE, training_settings))


def _ppl(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _size(n: int) -> str:
    from delta_attention.conversion.memory import human_bytes

    return human_bytes(n)


def markdown(report: dict) -> str:
    """The benchmark's tables: quality at short context, perplexity by position, passkey, cache and decode."""
    teacher = report["teacher"]
    rows = [("teacher", None, teacher)] + [(name, r, r["long_context"]) for name, r in report["models"].items()]
    buckets = [f"{b['start']}-{b['end']}" for b in teacher["long_ppl"]["buckets"]]
    lengths = sorted({int(n) for _, _, m in rows for n in m["passkey"]})
    contexts = sorted({d["context"] for _, _, m in rows for d in m["decode"]})
    if report.get("stage3_share"):
        stage3 = f"{report['stage3_share']:.0%} of it in stage 3 (blocks of {report['stage3_seq_len']:,})"
    else:
        stage3 = f"stage 3: {report['stage3_tokens']:,} tokens"
    lines = [f"Threads: {report['threads']}; {report['minutes_per_model']:g} min of distillation per model, {stage3}; "
             f"sliding window {report['attention_window']}. Teacher full fine-tuning: "
             f"{report['teacher_finetune_tokens_per_s']:.0f} tokens/s. Held-out and cross-domain perplexity after the "
             "last stage.", "",
             "| model | held-out ppl | vs teacher | cross-domain ppl | "
             + " | ".join(f"ppl {b}" for b in buckets) + " | tokens (1 + 2 + 3) |",
             "|---" * (5 + len(buckets)) + "|"]
    for name, r, m in rows:
        last = (r.get("stage3") or r["stage2"]) if r else None
        short = last["heldout_ppl"] if r else next(iter(report["models"].values()), {}).get("teacher_ppl")
        cross = last.get("crossdomain_ppl") if r else next(
            iter(report["models"].values()), {}).get("teacher_crossdomain_ppl")
        ratio = f"{short / r['teacher_ppl']:.2f}x" if r else "1.00x"
        cells = [_ppl(b["perplexity"]) for b in m["long_ppl"]["buckets"]]
        tokens = " + ".join(f"{r[f'stage{k}']['tokens']:,}" for k in (1, 2, 3) if f"stage{k}" in r) if r else "-"
        lines.append(f"| {name} | {_ppl(short)} | {ratio} | {_ppl(cross)} | " + " | ".join(cells) + f" | {tokens} |")
    if all("reset" in m["long_ppl"] for _, _, m in rows):
        lines += ["", f"Whole document / reset every {teacher['long_ppl']['reset']['window']:,} tokens (independent "
                  "windows, each from an empty cache): below 1x the longer context helps, above 1x it hurts.", "",
                  "| model | " + " | ".join(f"whole / reset {b}" for b in buckets) + " |",
                  "|---" * (1 + len(buckets)) + "|"]
        for name, _, m in rows:
            cells = ["-" if b["context_ratio"] is None else
                     f"{b['perplexity']:.2f} / {b['reset_perplexity']:.2f} ({b['context_ratio']:.2f}x)"
                     for b in m["long_ppl"]["buckets"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| model | " + " | ".join(f"passkey {n:,}" for n in lengths) + " | "
              + " | ".join(f"cache / ms per token at {c:,}" for c in contexts) + " |",
              "|---" * (1 + len(lengths) + len(contexts)) + "|"]
    for name, _, m in rows:
        passkey = {int(k): v for k, v in m["passkey"].items()}
        decode = {d["context"]: d for d in m["decode"]}
        cells = [f"{passkey[n]:.0%}" if n in passkey else "-" for n in lengths]
        cells += [f"{_size(decode[c]['cache_bytes'])} / {decode[c]['ms_per_token']:.1f}" if c in decode else "-"
                  for c in contexts]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("passkey_by_depth" in m for _, _, m in rows):  # results saved before it was recorded have none
        lines += passkey_depth_table(rows, lengths)
    return "\n".join(lines)


def passkey_depth_table(rows: list[tuple], lengths: list[int]) -> list[str]:
    """Markdown lines: passkey hits per length and needle depth (0 = the needle first, 1 = last), one row per model;
    a needle at depth d of an n-token prompt lies about (1 - d) n tokens back, which places it inside or beyond a
    sliding window."""
    grids = [(name, {int(n): {float(d): v for d, v in row.items()} for n, row in m.get("passkey_by_depth", {}).items()})
             for name, _, m in rows]
    columns = [(n, d) for n in lengths for d in sorted({d for _, g in grids for d in g.get(n, {})})]
    lines = ["", "Passkey by prompt length and needle depth (0 = at the start, 1 = just before the question):", "",
             "| model | " + " | ".join(f"{n:,} @ {d:g}" for n, d in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    for name, grid in grids:
        cells = [f"{grid[n][d]:.0%}" if d in grid.get(n, {}) else "-" for n, d in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict, path: Path) -> None:
    """Perplexity per position bucket, one line per model and the teacher."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    series = {"teacher": report["teacher"]} | {name: r["long_context"] for name, r in report["models"].items()}
    for name, measured in series.items():
        points = [(b["end"], b["perplexity"]) for b in measured["long_ppl"]["buckets"] if b["perplexity"] is not None]
        axis.plot(*zip(*points), "o-", label=name, color="black" if name == "teacher" else None)
    axis.set(xscale="log", yscale="log", xlabel="position in the document (bucket end, tokens)",
             ylabel="perplexity in the bucket", title="SmolLM2-135M conversions at long context")
    save_figure(figure, axis, path)


Options = BenchLongContextOptions

if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["bench-long-context", *sys.argv[1:]]))
