"""Recipe sweep: short distillations that each change one knob of the default recipe, scored out of domain.

The offline SmolLM2-135M-Instruct (or `--teacher`) is converted once per layer plan (calibrated init), then each
variant of the grid (`VARIANTS`, `--variants` picks some) is distilled in the same budget with `bench-distill`'s
`distill_in_budget`: `--minutes_per_variant` (each variant's stages probed for their speed), or fixed
`--stage1_tokens`/`--stage2_tokens` for exactly comparable runs. A variant is a dict of overrides of the baseline,
the current defaults: `distill` options (learning rates, stage-1 parameters, KL temperature), LoRA options (rank,
targets), the training text (`dataset`; `{dataset}` and `{generated}` are filled in from the options), the layer
plan (`keep_attention`; `{keep_attention}` likewise) and the other `convert` options in `CONVERT_KEYS` (the delta
layers' gate, negative eigenvalues; each distinct conversion is made once), `stage1_share`, the share of the budget
spent in stage 1 (with fixed token budgets: of their sum), and `seed` (data order and LoRA init: `baseline-seed-1`
measures the spread between two runs of one recipe, the margin a winner must beat).

Every variant is scored at the end of stage 2 by its cross-domain perplexity (`--crossdomain_dataset`, corpora held
out of training whole), its teacher-forced top-1 agreement with the teacher on that text, and its in-domain
held-out perplexity. The winner (`choose_winner`) has the lowest cross-domain perplexity ratio to the teacher; the
variants within `--tie_margin` of it count as tied, and the one of those that agrees most often with the teacher
wins. Writes `results.json`, `results.md` and `sweep.png` under `--output_dir`, and prints the winning overrides as
flags. A finished variant keeps its result in `variants/NAME/result.json` and is reused by a rerun with `--resume`
(when its settings are unchanged); a variant interrupted mid-way continues from its last training checkpoint (every
`--checkpoint_every_tokens`) when its settings are unchanged, and starts afresh otherwise.

    python -m delta_attention.scripts.sweep_recipe --minutes_per_variant 10
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .bench_distill import BenchDistillOptions, distill_in_budget, save_figure
from .resumable import (RESULT_FILE, as_saved, conversion_options, converted_options, option_changes, read_json,
                        start_part, write_json)

#: name -> overrides of the baseline; one knob each (the baseline changes none), but for the seed-1 confirmations
VARIANTS = {
    "baseline": {},
    "stage1-share-0.2": {"stage1_share": 0.2},
    "stage1-share-0.6": {"stage1_share": 0.6},
    "stage1-lr-3e-3": {"stage1_lr": 3e-3},  # the default before the sweep chose 1e-2
    "stage1-lr-3e-2": {"stage1_lr": 3e-2},
    "stage2-lr-3e-4": {"stage2_lr": 3e-4},  # the default before the sweep chose 3e-3
    "stage2-lr-1e-3": {"stage2_lr": 1e-3},
    "stage2-lr-1e-2": {"stage2_lr": 1e-2},
    "stage2-new-params-lr-3e-3": {"stage2_new_params_lr": 3e-3},  # the new delta parameters' rate in stage 2 (1e-3)
    "lora-r8": {"lora_r": 8, "lora_alpha": 16},
    "lora-r32": {"lora_r": 32, "lora_alpha": 64},
    "lora-all-linear": {"lora_target_modules": "all-linear"},
    "stage1-mixer": {"stage1_params": "mixer"},
    "temperature-2": {"temperature": 2.0},
    "stage2-ce-1": {"ce_weight": 1.0},
    "data-quote-mix": {"dataset": "{dataset}@0.7+quote:{dataset}@0.3"},
    "data-generated-mix": {"dataset": "{dataset}@0.5+generated:{generated}@0.5"},
    "data-generated-only": {"dataset": "generated:{generated}"},
    # the most varied training corpus (Brown: 15 genres) at 0.7 instead of 0.4: does text of other domains gain?
    "data-brown-0.7": {"dataset": "builtin:train:sotu=0.15,shakespeare=0.15,brown=0.7"},
    # a quarter of modern technical prose (Django's documentation), the others scaled to 0.75: the default mix since
    # the thirteenth sitting, named in full; the three corpora without it, the default before
    "data-django-0.25": {"dataset": "builtin:train:sotu=0.2625,shakespeare=0.1875,brown=0.3,django=0.25"},
    "data-three-corpora": {"dataset": "builtin:train:sotu=0.35,shakespeare=0.25,brown=0.4"},
    "layers-uniform": {"keep_attention": "{keep_attention}"},
    # the delta layers themselves (convert options): one decay per key channel (KDA; the default since the ninth
    # sitting, so now the baseline's) or one per head (Gated DeltaNet, the default before), and beta in (0, 2)
    # (negative eigenvalues of the state transition)
    "gate-channel": {"gate": "channel"},
    "gate-scalar": {"gate": "scalar"},
    "neg-eigval": {"allow_neg_eigval": True},
    # the auto plan's ranking after layer 0 and the induction layers: what converting each layer alone costs
    # (convert --rank_by conversion; the default since the twelfth sitting) or what bypassing its attention costs
    "rank-by-conversion": {"rank_by": "conversion"},
    "rank-by-bypass": {"rank_by": "bypass"},
    "baseline-seed-1": {"seed": 1},  # the baseline on another data order and LoRA init: the noise between runs
    # the fifth sitting's narrow leader on seed 1 (1.86x, as the baseline on seed 1: not adopted)
    "stage2-new-params-lr-3e-3-seed-1": {"stage2_new_params_lr": 3e-3, "seed": 1},
    # the eighth sitting's leader (1.72x against the baseline's 1.83x / 1.86x), on seed 1
    "gate-channel-seed-1": {"gate": "channel", "seed": 1},
    # the twelfth sitting's leader at a CPU-hour's tokens (cross-domain 1.15x, top-1 75.3%), on seed 1
    "rank-by-conversion-seed-1": {"rank_by": "conversion", "seed": 1},
    "data-django-0.25-seed-1": {"dataset": "builtin:train:sotu=0.2625,shakespeare=0.1875,brown=0.3,django=0.25",
                                "seed": 1},
    # a leader is confirmed on seed 1 by a variant with both overrides (NAME-seed-1) before it becomes the default
}
#: the baseline's layer plan (convert's default form): the share `--keep_attention` chosen by `auto:`
BASELINE_PLAN = "auto:{keep_attention}"
#: override keys that are `convert` options: a variant with any of them distils its own conversion
CONVERT_KEYS = ("keep_attention", "gate", "allow_neg_eigval", "rank_by")
#: override keys that are neither `distill` nor LoRA options
RUN_KEYS = ("stage1_share", "dataset", "seed", *CONVERT_KEYS)
#: `distill` options the sweep sets the same for every variant (the budget, the folders, the evaluation texts)
FIXED_KEYS = ("student", "teacher", "output_dir", "overwrite", "stage1_tokens", "stage2_tokens", "eval_tokens",
              "eval_dataset", "crossdomain_dataset")
RULE = ("lowest cross-domain perplexity ratio to the teacher; variants within --tie_margin of it are tied, and the one "
        "of those with the highest teacher-forced top-1 agreement wins (equal agreement: the lower ratio)")


@dataclasses.dataclass
class SweepRecipeOptions:
    output_dir: str = dataclasses.field(default="results/sweep-recipe", metadata={"help": "results folder"})
    variants: str = dataclasses.field(default="", metadata={
        "help": f"comma-separated subset of {list(VARIANTS)}; default: all (the data-generated ones with --generated)"})
    teacher: str | None = dataclasses.field(default=None, metadata={
        "help": "the model to convert and distill from (folder or .gguf); default: the offline SmolLM2-135M-Instruct"})
    generated: str = dataclasses.field(default="", metadata={
        "help": "a generate-data output folder for the data-generated variants"})
    dataset: str = dataclasses.field(default="builtin:train", metadata={"help": "the baseline's training text"})
    eval_dataset: str = dataclasses.field(default="builtin:heldout", metadata={"help": "in-domain held-out text"})
    crossdomain_dataset: str = dataclasses.field(default="builtin:crossdomain", metadata={
        "help": "text of other domains (never trained on): cross-domain perplexity and top-1 agreement"})
    keep_attention: str = dataclasses.field(default="0.25", metadata={
        "help": "the baseline's share of softmax layers, chosen by auto: as convert does by default (layers-uniform "
                "spreads the same share uniformly from layer 0)"})
    init: str = dataclasses.field(default="calibrated", metadata={"help": "init of the conversions (convert --init)"})
    minutes_per_variant: float = dataclasses.field(default=10.0, metadata={"help": "distillation time per variant"})
    stage1_share: float = dataclasses.field(default=0.4, metadata={"help": "the baseline's share of stage 1"})
    stage1_tokens: int = dataclasses.field(default=0, metadata={
        "help": "fixed stage-1 tokens of every variant (with --stage2_tokens; 0: from the time budget)"})
    stage2_tokens: int = dataclasses.field(default=0, metadata={
        "help": "fixed stage-2 tokens of every variant (with --stage1_tokens; 0: from the time budget)"})
    seq_len: int = dataclasses.field(default=512, metadata={"help": "training sequence length"})
    batch_size: int = dataclasses.field(default=4, metadata={"help": "blocks per step"})
    evaluations: int = dataclasses.field(default=2, metadata={"help": "held-out evaluations per stage"})
    eval_tokens: int = dataclasses.field(default=8192, metadata={
        "help": "tokens of each evaluation text (held-out, cross-domain) and of the agreement windows"})
    probe_steps: int = dataclasses.field(default=3, metadata={"help": "timed steps per speed probe"})
    packing: str = dataclasses.field(default="boundary", metadata={"help": "boundary or plain"})
    mixed_precision: str = dataclasses.field(default="auto", metadata={
        "help": "auto (bf16 autocast where the CPU has bf16 matmul units, else float32), bf16 or no (float32)"})
    tie_margin: float = dataclasses.field(default=0.01, metadata={
        "help": "cross-domain ratios within this of the lowest count as tied (agreement decides)"})
    checkpoint_every_tokens: int = dataclasses.field(default=8192, metadata={
        "help": "training checkpoint interval of each variant: what --resume continues an interrupted one from"})
    resume: bool = dataclasses.field(default=False, metadata={
        "help": "continue a sweep in output_dir: finished variants are reused, an interrupted one continues"})
    overwrite: bool = dataclasses.field(default=False, metadata={
        "help": "replace an existing output_dir (a sweep folder) once the new sweep is done"})
    keep_checkpoints: bool = dataclasses.field(default=False, metadata={
        "help": "keep a finished variant's training checkpoints, stage-1 model and speed probes (by default only "
                "its distilled model, metrics and report stay: about 0.6 instead of 1.4 GB a variant for SmolLM2)"})


def _fill(value, options: SweepRecipeOptions):
    """An override value with `{dataset}`, `{generated}` and `{keep_attention}` filled in from the options."""
    if not isinstance(value, str):
        return value
    return value.format(dataset=options.dataset, generated=options.generated, keep_attention=options.keep_attention)


def _overrides(options: SweepRecipeOptions, name: str) -> dict:
    """Variant `name`'s overrides with the options filled in (`_fill`)."""
    return {key: _fill(value, options) for key, value in VARIANTS[name].items()}


def _needs_generated(name: str) -> bool:
    return any("{generated}" in str(value) for value in VARIANTS[name].values())


def _same_setting(key: str, value, default) -> bool:
    """Whether an override is the default: equal, or for `dataset` two spellings of one `builtin:train` mix."""
    if key == "dataset" and isinstance(value, str) and isinstance(default, str):
        from delta_attention.conversion.data.text import builtin_train_mix

        mix, default_mix = builtin_train_mix(value), builtin_train_mix(default)
        if mix is not None and default_mix is not None:
            return mix.keys() == default_mix.keys() and all(
                math.isclose(mix[corpus], default_mix[corpus], abs_tol=1e-9) for corpus in mix)
    return value == default


def _repeats_baseline(name: str, defaults: dict) -> str | None:
    """The baseline variant (`baseline` or `baseline-seed-N`) whose recipe variant `name` is today: one whose every
    override but the seed is now a default (`defaults`: `recipe_defaults()` and the baseline's `dataset`; such as
    `gate-channel` since the channel gate became the default, or `data-django-0.25` since that mix did), or None."""
    overrides = {key: value for key, value in VARIANTS[name].items() if key != "seed"}
    if not overrides or any(key not in defaults or not _same_setting(key, value, defaults[key])
                            for key, value in overrides.items()):
        return None
    seed = VARIANTS[name].get("seed", 0)
    return f"baseline-seed-{seed}" if seed else "baseline"


def check_options(options: SweepRecipeOptions) -> list[str]:
    """Every check that reads no model: variant names, budgets, the data sources, the output folder. Returns the
    variants to run."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings
    from delta_attention.conversion.loading import check_model_spec
    from delta_attention.conversion.output_folder import check_output_folder
    from delta_attention.conversion.precision import check_cpu_mixed_precision
    from delta_attention.conversion.training.distill import DistillOptions
    from delta_attention.conversion.training.lora import LoraOptions

    names = [n.strip() for n in options.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    if not names:
        names = [n for n in VARIANTS if options.generated or not _needs_generated(n)]
        defaults = {**recipe_defaults(), "dataset": options.dataset}
        repeats = {n: _repeats_baseline(n, defaults) for n in names}
        if any(repeats.values()):
            print(f"left out {[n for n in names if repeats[n]]}: today's defaults make them the recipe of "
                  f"{sorted({r for r in repeats.values() if r})} (name them in --variants to run them anyway)")
            names = [n for n in names if not repeats[n]]
    missing = [n for n in names if _needs_generated(n) and not options.generated]
    if missing:
        raise ValueError(f"--variants {missing} train on teacher-generated text; pass --generated DIR (a "
                         "generate-data output folder) or leave them out")
    fixed = (options.stage1_tokens, options.stage2_tokens)
    if min(fixed) < 0 or (0 in fixed and max(fixed) > 0):
        raise ValueError(f"--stage1_tokens and --stage2_tokens must both be positive (fixed budgets) or both 0 (the "
                         f"time budget), got {fixed[0]} and {fixed[1]}")
    if not max(fixed) and not options.minutes_per_variant > 0:
        raise ValueError(f"--minutes_per_variant must be positive, got {options.minutes_per_variant}")
    for name in ("seq_len", "batch_size", "evaluations", "eval_tokens", "probe_steps"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(options, name)}")
    if options.checkpoint_every_tokens < 0:
        raise ValueError(f"--checkpoint_every_tokens must be >= 0 (0 = only at the end of each stage), "
                         f"got {options.checkpoint_every_tokens}")
    check_cpu_mixed_precision(options.mixed_precision)
    if not options.crossdomain_dataset.strip():
        raise ValueError("--crossdomain_dataset is empty; the sweep chooses by cross-domain perplexity (default "
                         "builtin:crossdomain)")
    if not options.tie_margin >= 0:
        raise ValueError(f"--tie_margin must be >= 0, got {options.tie_margin}")
    try:
        float(options.keep_attention)
    except ValueError:
        raise ValueError(f"--keep_attention must be a ratio such as 0.25 (chosen by auto:; the layers-uniform "
                         f"variant spreads the same share uniformly), got {options.keep_attention!r}") from None
    if options.teacher:
        check_model_spec(options.teacher, "teacher")
    distill_fields = {f.name for f in dataclasses.fields(DistillOptions)}
    lora_fields = {f.name for f in dataclasses.fields(LoraOptions)}
    for name in names:
        overrides = _overrides(options, name)
        keys = set(overrides)
        wrong = sorted((keys - distill_fields - lora_fields - set(RUN_KEYS)) | (keys & set(FIXED_KEYS)))
        if wrong:
            raise ValueError(f"variant {name}: {wrong} cannot be overridden; a variant changes distill or LoRA options "
                             f"other than {list(FIXED_KEYS)}, or {list(RUN_KEYS)}")
        share = overrides.get("stage1_share", options.stage1_share)
        if not 0 < share < 1:
            raise ValueError(f"variant {name}: stage1_share must lie in (0, 1), got {share}")
        LoraOptions(**{k: v for k, v in overrides.items() if k in lora_fields}).validate()
        _data(options, overrides).validate()
        ConversionSettings(**_conversion(options, name), init=options.init).validate()
    check_output_folder(options.output_dir, overwrite=options.overwrite, resume=options.resume,
                        inputs=(options.teacher, options.generated or None))
    return names


def _data(options: SweepRecipeOptions, overrides: dict):
    from delta_attention.conversion.data.text import DataOptions

    return DataOptions(dataset=overrides.get("dataset", options.dataset), seq_len=options.seq_len,
                       packing=options.packing, seed=overrides.get("seed", 0))


def _budget(options: SweepRecipeOptions, overrides: dict) -> BenchDistillOptions:
    """`distill_in_budget`'s options for one variant: the common budget, its stage split applied."""
    share = overrides.get("stage1_share", options.stage1_share)
    stage1, stage2 = options.stage1_tokens, options.stage2_tokens
    if stage1 and "stage1_share" in overrides:  # fixed budgets: the variant splits their sum by its share
        total = stage1 + stage2
        stage1, stage2 = max(1, round(total * share)), max(1, total - round(total * share))
    return BenchDistillOptions(output_dir=options.output_dir, minutes_per_model=options.minutes_per_variant,
                               stage1_share=share, seq_len=options.seq_len, batch_size=options.batch_size,
                               evaluations=options.evaluations, eval_tokens=options.eval_tokens,
                               probe_steps=options.probe_steps, packing=options.packing,
                               mixed_precision=options.mixed_precision, stage1_tokens=stage1, stage2_tokens=stage2)


def _conversion(options: SweepRecipeOptions, name: str) -> dict:
    """The `convert` options of variant `name`'s student: the baseline's layer plan (convert's defaults for the rest)
    with the variant's `CONVERT_KEYS` overrides."""
    overrides = _overrides(options, name)
    return {"keep_attention": _fill(BASELINE_PLAN, options),
            **{key: overrides[key] for key in CONVERT_KEYS if key in overrides}}


def _conversion_folder(conversion: dict) -> str:
    """The folder name of a conversion: `keep-auto-0.25`, then `-KEY-VALUE` per other option (`...-gate-channel`)."""
    name = "keep-" + conversion["keep_attention"].replace(":", "-")
    return name + "".join(f"-{key}-{value}" for key, value in conversion.items() if key != "keep_attention")


def recipe_defaults() -> dict:
    """The current defaults of the `convert`, `distill` and LoRA options that the variants change: every variant
    (the baseline too) is these defaults plus its overrides, so once a default changes no earlier result is
    reused."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings
    from delta_attention.conversion.training.distill import DISTILL_LORA_DROPOUT, DISTILL_LORA_TARGETS, DistillOptions
    from delta_attention.conversion.training.lora import LoraOptions

    lora = LoraOptions().resolved(DISTILL_LORA_TARGETS, DISTILL_LORA_DROPOUT)
    converting = {f.name: f.default for f in dataclasses.fields(ConversionSettings)
                  if f.name in CONVERT_KEYS and f.name != "keep_attention"}  # the plan is the sweep's own option
    defaults = {**{f.name: f.default for f in dataclasses.fields(DistillOptions)}, **dataclasses.asdict(lora),
                **converting}
    return {key: defaults[key] for key in sorted({k for o in VARIANTS.values() for k in o} & set(defaults))}


def _conversion_settings(conversion: dict, init: str):
    """The `ConversionSettings` the sweep converts `conversion` (a `_conversion` dict) with."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings

    return ConversionSettings(**conversion, init=init, dtype="float32")


def check_conversions(output_dir: Path, conversions: dict, init: str) -> None:
    """Refuse to reuse a conversion of an earlier sweep in `output_dir` (`--resume`) that was made with other
    `convert` options, as after a default changed, or without the channel gate's log-decay floor: before anything
    is written. `conversions` maps folder names to `_conversion` dicts."""
    for folder_name, conversion in conversions.items():
        converted = output_dir / "converted" / folder_name
        found = converted_options(converted)
        if found is None:
            continue
        options = conversion_options(_conversion_settings(conversion, init))
        changed = option_changes(found, {key: options[key] for key in (*CONVERT_KEYS, "init", "log_decay_floor")})
        if changed:
            raise ValueError(f"{converted} was converted with other options ({changed}): continue this sweep in a "
                             f"new --output_dir (or delete that folder to convert it again).")


def _settings(options: SweepRecipeOptions, name: str) -> dict:
    """What determines a variant's result: a finished one is reused only while these are unchanged."""
    fields = ("teacher", "dataset", "eval_dataset", "crossdomain_dataset", "keep_attention", "init",
              "minutes_per_variant", "stage1_share", "stage1_tokens", "stage2_tokens", "seq_len", "batch_size",
              "evaluations", "eval_tokens", "packing", "mixed_precision")
    return as_saved({"overrides": _overrides(options, name), "recipe": recipe_defaults(),
                     **{field: getattr(options, field) for field in fields}})


def scores(results: dict) -> dict:
    """A variant's scores from `run_distill`'s results (after stage 2)."""
    stage1, stage2 = results["stage1"], results["stage2"]
    return {
        "heldout_ppl": stage2["heldout_ppl"], "teacher_ppl": results["teacher_ppl"],
        "heldout_ratio": stage2["heldout_ppl"] / results["teacher_ppl"],
        "crossdomain_ppl": stage2["crossdomain_ppl"], "teacher_crossdomain_ppl": results["teacher_crossdomain_ppl"],
        "crossdomain_ratio": stage2["crossdomain_ppl"] / results["teacher_crossdomain_ppl"],
        "top1_agreement": results["agreement"]["top1_agreement"],
        "continuation_prefix": results["agreement"]["continuation"]["mean_matching_prefix"],
        "stage1_tokens": stage1["tokens"], "stage2_tokens": stage2["tokens"],
        "wall_seconds": results["wall_seconds"],
    }


def choose_winner(variants: dict, tie_margin: float) -> str:
    """The winning variant name of `{name: {"scores": ...}}` by `RULE` (a non-finite ratio never wins)."""
    finite = {n: v["scores"] for n, v in variants.items() if math.isfinite(v["scores"]["crossdomain_ratio"])}
    if not finite:
        raise ArithmeticError("no variant has a finite cross-domain perplexity; nothing to choose from")
    best = min(s["crossdomain_ratio"] for s in finite.values())
    tied = [n for n, s in finite.items() if s["crossdomain_ratio"] <= best + tie_margin]
    return max(tied, key=lambda n: (finite[n]["top1_agreement"], -finite[n]["crossdomain_ratio"]))


def changed(overrides: dict) -> str:
    """The "what changed" cell: `key value` per override, or "defaults"."""
    return ", ".join(f"{key} {value}" for key, value in overrides.items()) or "defaults"


def winner_flags(variant: dict) -> list[str]:
    """The command lines that reproduce the winner's recipe: convert's layer plan (when it changed) and distill's
    flags (a changed stage split as the token budgets it ran)."""
    overrides, s = variant["overrides"], variant["scores"]
    lines = []
    converting = [f"--{key} {value}" for key, value in overrides.items() if key in CONVERT_KEYS]
    if converting:
        lines.append(" ".join(["delta-attention convert TEACHER", *converting, "--out STUDENT"]))
    flags = [f"--{key} {value}" for key, value in overrides.items()
             if key != "stage1_share" and key not in CONVERT_KEYS]
    if "stage1_share" in overrides:
        flags = [f"--stage1_tokens {s['stage1_tokens']}", f"--stage2_tokens {s['stage2_tokens']}", *flags]
    lines.append(" ".join(["delta-attention distill STUDENT", *flags]) + ("" if flags else "  (the defaults)"))
    return lines


def run_variant(folder: Path, converted: Path, teacher: str, options: SweepRecipeOptions, name: str,
                resume: bool = False) -> dict:
    """Distill one variant in the common budget under `folder` (`resume`: continue its interrupted run); returns its
    results with the scores."""
    from delta_attention.conversion.training.loop import TrainingOptions
    from delta_attention.conversion.training.lora import LoraOptions

    lora_fields = {f.name for f in dataclasses.fields(LoraOptions)}
    overrides = _overrides(options, name)
    distill = {k: v for k, v in overrides.items() if k not in lora_fields and k not in RUN_KEYS}
    lora = LoraOptions(**{k: v for k, v in overrides.items() if k in lora_fields})
    training = TrainingOptions(batch_size=options.batch_size, mixed_precision=options.mixed_precision,
                               checkpoint_every_tokens=options.checkpoint_every_tokens)
    results = distill_in_budget(folder, converted, teacher, _data(options, overrides), training,
                                _budget(options, overrides), lora=lora, resume=resume,
                                eval_dataset=options.eval_dataset,
                                crossdomain_dataset=options.crossdomain_dataset, **distill)
    return {"overrides": overrides, "scores": scores(results), "results": results}


def prune_finished(place: Path) -> None:
    """Delete what a finished variant in `place` no longer needs: the checkpoints and stage-1 model of its distill run
    (`run/`, which distill marked as its own) and the speed probes; its distilled model, metrics and report stay."""
    from delta_attention.conversion.output_folder import RUN_MARKER

    run = place / "run"
    if not (run / RUN_MARKER).is_file():
        return
    for folder in [*run.glob("stage*/checkpoints"), run / "stage1" / "model", *place.glob("probe[0-9]")]:
        if folder.is_dir():
            shutil.rmtree(folder)


def run(options: SweepRecipeOptions) -> int:
    from delta_attention.conversion.converter.pipeline import convert
    from delta_attention.conversion.converter.sources import load_source
    from delta_attention.conversion.data.assets import smollm2_gguf_path
    from delta_attention.conversion.output_folder import open_run_folder
    from delta_attention.conversion.saving import write_text_atomically

    names = check_options(options)
    teacher = options.teacher or str(smollm2_gguf_path())
    conversions = {_conversion_folder(c): c for c in (_conversion(options, n) for n in names)}
    if options.resume:
        check_conversions(Path(options.output_dir), conversions, options.init)
    folder = open_run_folder(Path(options.output_dir), "sweep-recipe", overwrite=options.overwrite,
                             resume=options.resume)
    out = folder.work
    source = None
    for folder_name, conversion in sorted(conversions.items()):
        converted = out / "converted" / folder_name
        if not converted.is_dir():
            source = source or load_source(teacher, dtype=torch.float32)
            convert(source, out=converted, settings=_conversion_settings(conversion, options.init))
    del source
    report = {"threads": torch.get_num_threads(), "rule": RULE, "tie_margin": options.tie_margin,
              "minutes_per_variant": options.minutes_per_variant, "fixed_tokens": [options.stage1_tokens,
                                                                                    options.stage2_tokens],
              "teacher": teacher, "crossdomain_dataset": options.crossdomain_dataset,
              "eval_dataset": options.eval_dataset, "recipe": recipe_defaults(), "variants": {}}
    for i, name in enumerate(tqdm(names, desc="recipe sweep", unit="variant"), 1):
        place = out / "variants" / name
        settings = _settings(options, name)
        done = read_json(place / RESULT_FILE)
        if done is not None and done["settings"] == settings:
            verb = "reused"
        else:
            continuing = start_part(place, settings)
            converted = out / "converted" / _conversion_folder(_conversion(options, name))
            done = {"settings": settings, **run_variant(place, converted, teacher, options, name, resume=continuing)}
            write_json(place / RESULT_FILE, done)
            verb = "ran"
        if not options.keep_checkpoints:
            prune_finished(place)
        report["variants"][name] = {k: done[k] for k in ("overrides", "scores")}
        s = done["scores"]
        tqdm.write(f"[{i}/{len(names)}] {name} ({verb}): cross-domain {s['crossdomain_ratio']:.2f}x the teacher, "
                   f"in-domain {s['heldout_ratio']:.2f}x, top-1 agreement {s['top1_agreement']:.1%}, "
                   f"{s['wall_seconds'] / 60:.1f} min")
        write_json(out / "results.json", report)

    report["winner"] = choose_winner(report["variants"], options.tie_margin)
    write_json(out / "results.json", report)
    write_text_atomically(out / "results.md", markdown(report))
    plot(report, out / "sweep.png")
    folder.finish()
    print(markdown(report))
    print(f"\nwinner: {report['winner']}; its recipe:")
    for line in winner_flags(report["variants"][report["winner"]]):
        print(f"  {line}")
    return 0


def markdown(report: dict) -> str:
    """The sweep table (one row per variant, the winner in bold) with the budget and the rule above it."""
    first = next(iter(report["variants"].values()))["scores"]
    budget = (f"{report['fixed_tokens'][0]:,} + {report['fixed_tokens'][1]:,} tokens" if report["fixed_tokens"][0]
              else f"{report['minutes_per_variant']:g} min")
    lines = [f"Threads: {report['threads']}; {budget} per variant. Teacher: held-out perplexity "
             f"{first['teacher_ppl']:.2f}, cross-domain ({report['crossdomain_dataset']}) "
             f"{first['teacher_crossdomain_ppl']:.2f}. Winner ({report['rule']}): **{report.get('winner', '-')}**.",
             "", "Defaults the variants change (the baseline's recipe): "
             + ", ".join(f"{key} {value}" for key, value in report["recipe"].items()) + ".",
             "", "| variant | what changed | in-domain ppl | cross-domain ppl | in-domain / teacher | "
             "cross-domain / teacher | top-1 agreement | tokens (1 + 2) | wall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        s = v["scores"]
        shown = f"**{name}**" if name == report.get("winner") else name
        lines.append(f"| {shown} | {changed(v['overrides'])} | {s['heldout_ppl']:.2f} | {s['crossdomain_ppl']:.2f} | "
                     f"{s['heldout_ratio']:.2f}x | {s['crossdomain_ratio']:.2f}x | {s['top1_agreement']:.1%} | "
                     f"{s['stage1_tokens']:,} + {s['stage2_tokens']:,} | {s['wall_seconds'] / 60:.1f} min |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """In-domain and cross-domain perplexity ratios to the teacher per variant, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["variants"])
    figure, axis = plt.subplots(figsize=(7, 1.5 + 0.35 * len(names)))
    for offset, key, label in ((-0.2, "heldout_ratio", "in-domain"), (0.2, "crossdomain_ratio", "cross-domain")):
        axis.barh([i + offset for i in range(len(names))],
                  [report["variants"][n]["scores"][key] for n in names], height=0.4, label=label)
    axis.set_yticks(range(len(names)), [f"{n} *" if n == report.get("winner") else n for n in names])
    axis.invert_yaxis()
    axis.axvline(1.0, color="black", linestyle="--", label="teacher")
    axis.set(xlabel="perplexity / teacher's (lower is better; * the winner)", title="recipe sweep")
    save_figure(figure, axis, path)


Options = SweepRecipeOptions

if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["sweep-recipe", *sys.argv[1:]]))
