"""`distill`: the two-stage recipe from a converted folder to a distilled model, resumable stage by stage, and an
optional third stage on long blocks (`--stages 1,2,3`).

Folder layout of a run (`output_dir`):
    stage1/checkpoints/, stage1/metrics.jsonl, stage1/model/     attention transfer and its result
    stage2/checkpoints/, stage2/metrics.jsonl                    logit distillation with LoRA
    stage3/checkpoints/, stage3/metrics.jsonl                    long-context distillation (same LoRA, long blocks)
    model/ (merged, default) or adapter/                         the result, with an updated model card
    results.json, metrics.png                                    evaluation table and curves
Every model folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from ..converter.sources import SOURCE_ATTRIBUTE
from ..data.text import PACKINGS, DataOptions, evaluation_windows, training_blocks, warn_if_longer_than_model
from ..evaluation.agreement import AgreementSettings, agreement_inputs, agreement_markdown, measure_agreement
from ..evaluation.perplexity import perplexity
from ..loading import check_model_spec, load_model
from ..output_folder import check_output_folder, on_main_process, open_run_folder_once
from ..publishing.cards import distilled_card, results_table
from ..saving import atomic_save, save_model_and_tokenizer, write_text_atomically
from .lora import LoraOptions, lora_config
from .loop import TrainingOptions, run_training
from .metrics import plot_metrics
from .objectives import (
    AttentionTransfer,
    ChunkedLogitDistillation,
    HeldoutEvaluator,
    LogitDistillation,
    add_lora,
    batch_inputs,
    delta_layer_indices,
    freeze_all,
    stage1_parameters,
)



@dataclasses.dataclass
class DistillOptions:
    """What to distill and the recipe of each stage."""

    student: str = dataclasses.field(
        default=None, metadata={"help": "converted model folder (output of `convert`)", "positional": True}
    )
    teacher: str | None = dataclasses.field(
        default=None, metadata={"help": "the source model (Hub id, folder or .gguf); default: the one convert recorded"}
    )
    output_dir: str = dataclasses.field(default="distilled", metadata={"help": "run folder"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output_dir (a run of this tool) once the new run is done"}
    )
    force_overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "with --overwrite: replace output_dir even if this tool did not write it"}
    )
    stages: str = dataclasses.field(
        default="1,2", metadata={"help": "stages to run: 1, 2, 1,2 or 1,2,3 (3: long-context distillation)"}
    )
    stage1_tokens: int = dataclasses.field(default=200_000, metadata={"help": "token budget of attention transfer"})
    stage1_lr: float = dataclasses.field(default=1e-2, metadata={
        "help": "learning rate of stage 1 (1e-2 won the recipe sweep over 3e-3 on two seeds)"})
    stage1_params: str = dataclasses.field(
        default="new", metadata={"help": "new: only the new delta parameters; mixer: the whole delta layers"}
    )
    stage2_tokens: int = dataclasses.field(default=200_000, metadata={"help": "token budget of logit distillation"})
    stage2_lr: float = dataclasses.field(default=3e-3, metadata={
        "help": "learning rate of the LoRA weights (3e-3 won the recipe sweep over 3e-4, 1e-3 and 1e-2 on two seeds)"})
    stage2_new_params_lr: float = dataclasses.field(
        default=1e-3, metadata={"help": "learning rate of the new delta parameters in stage 2"}
    )
    stage2_logit_chunk: int = dataclasses.field(
        default=128, metadata={"help": "positions (over the batch) per chunk of stage 2's logits and KL (128: each "
                                       "chunk's float32 tensors stay small enough to be reused rather than mapped "
                                       "afresh); 0: the whole [batch, seq_len, vocab] logits at once (the plain "
                                       "reference, more memory)"}
    )
    compile_kl: bool = dataclasses.field(
        default=True, metadata={"help": "torch.compile the KL of each chunk of logits (stages 2 and 3): inductor fuses "
                                        "its float32 passes, 6-7x faster on CPU; where it cannot compile (no C++ "
                                        "compiler) one warning and the eager form (--no_compile_kl: always eager)"}
    )
    stage3_tokens: int = dataclasses.field(
        default=65_536, metadata={"help": "token budget of long-context distillation (stage 3)"}
    )
    stage3_seq_len: int = dataclasses.field(default=4096, metadata={"help": "tokens per stage-3 block"})
    stage3_batch_size: int = dataclasses.field(
        default=1, metadata={"help": "stage-3 blocks per optimizer step (over all processes and accumulation steps)"}
    )
    stage3_packing: str = dataclasses.field(
        default="plain",
        metadata={"help": "plain: one run of positions per stage-3 block, the delta state carried across documents; "
                          "boundary: positions restart per document (blocks are then as long as the documents)"},
    )
    stage3_lr: float = dataclasses.field(default=1e-4, metadata={"help": "learning rate of the LoRA weights, stage 3"})
    stage3_new_params_lr: float = dataclasses.field(
        default=3e-4, metadata={"help": "learning rate of the new delta parameters in stage 3"}
    )
    stage3_gradient_checkpointing: bool = dataclasses.field(
        default=True, metadata={"help": "recompute the student's layer activations in stage 3's backward pass"}
    )
    stage3_logit_chunk: int = dataclasses.field(
        default=512, metadata={"help": "positions per chunk of stage 3's logits and KL (bounds the logits held)"}
    )
    temperature: float = dataclasses.field(default=1.0, metadata={"help": "distillation temperature"})
    ce_weight: float = dataclasses.field(default=0.0, metadata={"help": "weight of a cross-entropy term in stage 2"})
    output: str = dataclasses.field(
        default="merged", metadata={"help": "merged: the merged model; adapter: the LoRA adapter over stage1/model"}
    )
    eval_dataset: str = dataclasses.field(
        default="builtin:heldout", metadata={"help": "evaluation texts (never trained on); same forms as --dataset"}
    )
    eval_tokens: int = dataclasses.field(default=16_384, metadata={"help": "held-out tokens for perplexity (0 = none)"})
    eval_seq_len: int | None = dataclasses.field(default=None, metadata={"help": "evaluation window (default seq_len)"})
    crossdomain_dataset: str = dataclasses.field(default="auto", metadata={
        "help": "texts of other domains and eras (never trained on) whose perplexity is measured at the end of each "
                "stage, beside the held-out one; auto: builtin:crossdomain when --eval_dataset is built-in, else "
                "none; '' for none"})
    agreement: bool = dataclasses.field(default=True, metadata={
        "help": "after stage 2, measure agreement with the teacher (top-1, greedy continuations, chat answers; "
                "needs --eval_tokens > 0)"})
    agreement_dataset: str = dataclasses.field(default="auto", metadata={
        "help": "texts for the agreement measures (as --dataset); auto: the cross-domain set when there is one "
                "(see --crossdomain_dataset), else --eval_dataset"})


def _parse_stages(text: str) -> set[int]:
    parts = [s for s in text.replace(" ", "").split(",") if s]
    if not parts or any(p not in ("1", "2", "3") for p in parts):
        raise ValueError(f"--stages must name stages 1 and/or 2 and/or 3 (e.g. --stages 1,2 or --stages 1,2,3), "
                         f"got {text!r}")
    return {int(p) for p in parts}


def _check_options(options: DistillOptions, data: DataOptions, training: TrainingOptions) -> set[int]:
    """Every check that needs no model: options, the student folder, the output folder. Returns the stages."""
    if not options.student:
        raise ValueError("give the converted model folder: delta-attention distill STUDENT_DIR --output_dir OUT")
    check_model_spec(options.student, "student")
    if options.output not in ("merged", "adapter"):
        raise ValueError(f"--output must be 'merged' or 'adapter', got {options.output!r}")
    stages = _parse_stages(options.stages)
    for name in ("stage1_tokens", "stage2_tokens", "stage3_tokens", "stage3_batch_size", "stage3_logit_chunk"):
        if getattr(options, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(options, name)}")
    if options.stage2_logit_chunk < 0:
        raise ValueError(f"--stage2_logit_chunk must be >= 0 (0 = the whole logits at once), "
                         f"got {options.stage2_logit_chunk}")
    if options.stage3_seq_len < 2:
        raise ValueError(f"--stage3_seq_len must be at least 2, got {options.stage3_seq_len}")
    if options.stage3_packing not in PACKINGS:
        raise ValueError(f"--stage3_packing must be one of {', '.join(PACKINGS)}, got {options.stage3_packing!r}")
    if 3 in stages and options.stage3_batch_size % training.gradient_accumulation_steps:
        raise ValueError(f"--stage3_batch_size ({options.stage3_batch_size}) must be a multiple of "
                         f"--gradient_accumulation_steps ({training.gradient_accumulation_steps})")
    if options.teacher:
        check_model_spec(options.teacher, "teacher")
    training.validate()
    data.validate()
    check_output_folder(options.output_dir, overwrite=options.overwrite, resume=training.resume,
                        force=options.force_overwrite, inputs=(options.student, options.teacher, data.dataset))
    return stages


def _load_student(folder: str):
    model, _ = load_model(folder, require_delta=True, tokenizer=False, what="student")
    return model


def _load_teacher(options: DistillOptions, student):
    from ..converter.sources import load_source

    spec = options.teacher or getattr(student.config, SOURCE_ATTRIBUTE, None)
    if not spec:
        raise ValueError(f"{options.student} does not record its source model; pass --teacher SOURCE")
    if not options.teacher:
        check_model_spec(spec, f"teacher (recorded by convert in {options.student})")
    source = load_source(spec, dtype=torch.float32)
    teacher = source.model.eval()
    freeze_all(teacher)
    check_teacher_matches(teacher, student, spec)
    return teacher, source.tokenizer


#: config fields that a student shares with the model it was converted from
_SHARED_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads")


def check_teacher_matches(teacher, student, spec: str) -> None:
    """Raise when `teacher` is not the model `student` was converted from: another shape, or other weights
    (conversion copies the embeddings, and distillation never trains them)."""
    wrong = [f"{name} {getattr(teacher.config, name, None)} vs {getattr(student.config, name, None)}"
             for name in _SHARED_SHAPE if getattr(teacher.config, name, None) != getattr(student.config, name, None)]
    if not wrong:
        ours = student.get_input_embeddings().weight.detach().float()
        theirs = teacher.get_input_embeddings().weight.detach().float()
        error = (ours - theirs).norm() / theirs.norm().clamp(min=1e-12)
        if error > 1e-2:
            wrong = [f"its token embeddings differ from the student's (relative difference {error:.3g})"]
    if wrong:
        recorded = getattr(student.config, SOURCE_ATTRIBUTE, None)
        raise ValueError(
            f"the teacher {spec} is not the model the student was converted from ({'; '.join(wrong)}); pass the "
            "source given to `delta-attention convert`" + (f" (recorded: {Path(recorded).name})" if recorded else "")
        )


def _load_tokenizer(folder: str, fallback):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError):
        if fallback is None:
            raise ValueError(f"{folder} has no tokenizer and the teacher has none either") from None
        return fallback


#: the precision of every held-out perplexity in results.json (`eval_precision`)
EVAL_PRECISION = "float32"

#: LoRA of stage 2 unless the options say otherwise: the copied attention projections, no dropout
DISTILL_LORA_TARGETS, DISTILL_LORA_DROPOUT = "q_proj,k_proj,v_proj,o_proj", 0.0


def run_distill(options: DistillOptions, data: DataOptions, training: TrainingOptions,
                lora: LoraOptions | None = None) -> dict:
    """Run the stages asked for; returns the evaluation results (also written to `output_dir/results.json`).

    Every input is checked and loaded before the output folder is touched; with `--overwrite` the new run works in
    a staging folder that replaces the old one only when the run is complete."""
    stages = _check_options(options, data, training)
    lora = (lora or LoraOptions()).validate().resolved(DISTILL_LORA_TARGETS, DISTILL_LORA_DROPOUT)
    student = _load_student(options.student)
    teacher, teacher_tokenizer = _load_teacher(options, student)
    tokenizer = _load_tokenizer(options.student, teacher_tokenizer)
    warn_if_longer_than_model(data.seq_len, student.config)
    blocks = training_blocks(data, tokenizer) if stages & {1, 2} else None
    long_blocks = _stage3_blocks(options, data, tokenizer, teacher.config) if 3 in stages else None
    eval_windows = crossdomain_windows = None
    if options.eval_tokens:
        seq = options.eval_seq_len or data.seq_len
        eval_windows = evaluation_windows(options.eval_dataset, tokenizer, seq, max(1, options.eval_tokens // seq))
        crossdomain = _crossdomain_source(options)
        if crossdomain:
            crossdomain_windows = evaluation_windows(crossdomain, tokenizer, seq, max(1, options.eval_tokens // seq))
    agreement = None  # what the agreement measures at the end compare: (inputs, settings, source)
    if options.agreement and options.eval_tokens and 2 in stages:
        source = options.agreement_dataset
        if source == "auto":
            source = _crossdomain_source(options) or options.eval_dataset
        settings = AgreementSettings(seq_len=options.eval_seq_len or data.seq_len, tokens=options.eval_tokens,
                                     seed=data.seed)
        agreement = (agreement_inputs(tokenizer, source, settings), settings, source)

    run = open_run_folder_once(Path(options.output_dir), "distill", overwrite=options.overwrite,
                               resume=training.resume)
    out = run.work
    torch.manual_seed(data.seed)
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    # every perplexity of the table (teacher, untrained, after each stage) is scored the same way: float32
    # weights, no autocast (the training loop evaluates outside its bf16 autocast)
    results["eval_precision"] = EVAL_PRECISION
    evaluate = None
    if eval_windows is not None:
        evaluate = HeldoutEvaluator(eval_windows)
        if "teacher_ppl" not in results:
            results["teacher_ppl"] = perplexity(teacher, eval_windows, desc="teacher perplexity")
            results["converted_ppl"] = perplexity(student, eval_windows, desc="untrained student perplexity")
        if crossdomain_windows is not None and "teacher_crossdomain_ppl" not in results:
            results["crossdomain_dataset"] = crossdomain
            results["teacher_crossdomain_ppl"] = _crossdomain_ppl(teacher, crossdomain_windows)
            results["converted_crossdomain_ppl"] = _crossdomain_ppl(student, crossdomain_windows)
    layers = delta_layer_indices(student)
    results.update(recipe={"stages": sorted(stages), "seq_len": data.seq_len, "dataset": data.dataset,
                           "batch_size": training.batch_size,
                           "mixed_precision": training.precision()})

    stage1_model = out / "stage1" / "model"
    if 1 in stages:
        if stage1_model.is_dir():
            print(f"stage 1 already complete in {stage1_model}; loading it")
            student = _load_student(str(stage1_model))
        else:
            freeze_all(student)
            params = stage1_parameters(student, layers, options.stage1_params)
            for p in params:
                p.requires_grad_(True)
            objective = AttentionTransfer(teacher, student, layers)
            started = time.perf_counter()
            result = run_training(
                objective, _objective_loss, [{"params": params, "lr": options.stage1_lr}], blocks,
                training, out / "stage1", options.stage1_tokens, seed=data.seed,
                evaluate=(lambda _: evaluate(student)) if evaluate else None, description="stage 1 (attention transfer)",
            )
            results["stage1"] = {"tokens": result.tokens, "seconds": time.perf_counter() - started,
                                 "tokens_per_s": result.tokens / max(result.seconds, 1e-9), "final_mse": result.final_loss,
                                 "lr": options.stage1_lr, "params": options.stage1_params,
                                 "heldout_ppl": result.evaluations[-1]["heldout_ppl"] if result.evaluations else None,
                                 "crossdomain_ppl": _crossdomain_ppl(student, crossdomain_windows)}
            on_main_process(atomic_save, lambda folder: save_model_and_tokenizer(student, tokenizer, folder),
                             stage1_model)
        on_main_process(_write_results, out, results)

    if stages & {2, 3}:  # stage 3 goes on training stage 2's LoRA (and new parameters) on long blocks
        torch.manual_seed(data.seed + 1)  # the LoRA initialisation: the same --seed gives the same run
        peft_model, new_params = add_lora(student, lora_config(lora))
        lora_params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
        # an adapter carries only LoRA weights: keep the new parameters as stage 1 left them
        if options.output != "merged":
            for p in new_params:
                p.requires_grad_(False)

        def groups(lr: float, new_params_lr: float) -> list[dict]:
            """AdamW groups of stages 2 and 3: the LoRA weights, and the new delta parameters when they train."""
            trained = [{"params": new_params, "lr": new_params_lr}] if options.output == "merged" else []
            return [{"params": lora_params, "lr": lr}, *trained]

        if 2 in stages:
            objective = LogitDistillation(teacher, peft_model, options.temperature, options.ce_weight,
                                          options.stage2_logit_chunk or None, options.compile_kl)
            started = time.perf_counter()
            result = run_training(
                objective, _answer_loss, groups(options.stage2_lr, options.stage2_new_params_lr), blocks, training,
                out / "stage2", options.stage2_tokens, seed=data.seed + 1,
                evaluate=(lambda _: evaluate(peft_model)) if evaluate else None,
                description="stage 2 (logit distillation)",
            )
            results["stage2"] = {"tokens": result.tokens, "seconds": time.perf_counter() - started,
                                 "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                                 "final_loss": result.final_loss,
                                 "lr": options.stage2_lr, "new_params_lr": options.stage2_new_params_lr,
                                 "lora": lora.record(),
                                 "temperature": options.temperature, "ce_weight": options.ce_weight,
                                 "logit_chunk": options.stage2_logit_chunk,
                                 "heldout_ppl": result.evaluations[-1]["heldout_ppl"] if result.evaluations else None,
                                 "crossdomain_ppl": _crossdomain_ppl(peft_model, crossdomain_windows)}
            on_main_process(_write_results, out, results)
        if 3 in stages:
            results["stage3"] = _long_context_stage(
                options, data, training, teacher, peft_model, groups(options.stage3_lr, options.stage3_new_params_lr),
                long_blocks, out / "stage3", evaluate)
            results["stage3"]["lora"] = lora.record()
            results["stage3"]["crossdomain_ppl"] = _crossdomain_ppl(peft_model, crossdomain_windows)
        if agreement is not None:
            results["agreement"] = measure_agreement(peft_model, teacher, tokenizer, *agreement)
        if options.output == "merged":
            merged = peft_model.merge_and_unload()
            on_main_process(atomic_save, lambda folder: _save_distilled(merged, tokenizer, folder, options, results),
                             out / "model")
        else:
            _record_adapter_base(peft_model, options, trained_stage1=1 in stages)
            on_main_process(atomic_save, peft_model.save_pretrained, out / "adapter")
        on_main_process(_write_results, out, results)

    runs = {f"stage {s}": out / f"stage{s}" / "metrics.jsonl" for s in (1, 2, 3)
            if (out / f"stage{s}" / "metrics.jsonl").exists()}
    if runs:
        on_main_process(plot_metrics, runs, out / "metrics.png", title=f"distilling {Path(options.student).name}")
    on_main_process(run.finish)
    print(results_table(results))
    return results


def _stage3_blocks(options: DistillOptions, data: DataOptions, tokenizer, teacher_config):
    """Stage 3's long blocks: `--dataset` packed to `--stage3_seq_len` with `--stage3_packing` (one-line errors name
    the stage-3 flags)."""
    limit = getattr(teacher_config, "max_position_embeddings", None)
    if isinstance(limit, int) and options.stage3_seq_len > limit:
        print(f"warning: --stage3_seq_len {options.stage3_seq_len} is longer than the teacher's "
              f"max_position_embeddings ({limit}); its targets past position {limit} come from positions it never "
              "trained on", file=sys.stderr)
    long_data = dataclasses.replace(data, seq_len=options.stage3_seq_len, packing=options.stage3_packing)
    try:
        return training_blocks(long_data, tokenizer)
    except ValueError as error:
        if "not enough text" not in str(error):
            raise
        raise ValueError(f"stage 3: {error}; lower --stage3_seq_len or give --dataset more text") from None


def _long_context_stage(options: DistillOptions, data: DataOptions, training: TrainingOptions, teacher, peft_model,
                        groups: list[dict], blocks, folder: Path, evaluate) -> dict:
    """Stage 3: KL distillation on `--stage3_seq_len` blocks, the logits made in chunks, the student's layers
    recomputed in the backward pass (`--stage3_gradient_checkpointing`); returns its entry of results.json."""
    torch.manual_seed(data.seed + 2)  # LoRA dropout, if any, starts from the same state whether resumed or not
    long_training = dataclasses.replace(
        training, batch_size=options.stage3_batch_size,
        gradient_checkpointing=options.stage3_gradient_checkpointing or training.gradient_checkpointing)
    objective = ChunkedLogitDistillation(teacher, peft_model, options.temperature, options.ce_weight,
                                         options.stage3_logit_chunk, options.compile_kl)
    started = time.perf_counter()
    result = run_training(
        objective, _answer_loss, groups, blocks, long_training, folder, options.stage3_tokens, seed=data.seed + 2,
        evaluate=(lambda _: evaluate(peft_model)) if evaluate else None,
        description="stage 3 (long-context distillation)",
    )
    return {"tokens": result.tokens, "seconds": time.perf_counter() - started,
            "tokens_per_s": result.tokens / max(result.seconds, 1e-9), "final_loss": result.final_loss,
            "lr": options.stage3_lr, "new_params_lr": options.stage3_new_params_lr,
            "seq_len": options.stage3_seq_len, "batch_size": options.stage3_batch_size,
            "packing": options.stage3_packing, "gradient_checkpointing": long_training.gradient_checkpointing,
            "logit_chunk": options.stage3_logit_chunk,
            "temperature": options.temperature, "ce_weight": options.ce_weight,
            "heldout_ppl": result.evaluations[-1]["heldout_ppl"] if result.evaluations else None}


def _crossdomain_source(options: DistillOptions) -> str:
    """The cross-domain evaluation source `--crossdomain_dataset` names ("" for none; see its help for auto)."""
    if options.crossdomain_dataset != "auto":
        return options.crossdomain_dataset
    return "builtin:crossdomain" if options.eval_dataset.startswith("builtin:") else ""


def _crossdomain_ppl(model, windows) -> float | None:
    """Perplexity of `model` on the cross-domain windows (None without them), in eval mode and float32 like every
    perplexity of results.json."""
    if windows is None:
        return None
    was_training = model.training
    model.eval()
    try:
        return perplexity(model, windows, desc="cross-domain perplexity")
    finally:
        model.train(was_training)


def _objective_loss(objective, batch):
    """The training loop's `compute_loss` for every stage: the objective module on the batch's token ids (and
    position ids when the blocks are packed with document boundaries)."""
    return objective(**batch_inputs(batch))


def _answer_loss(objective, batch):
    """Stage 2's and stage 3's `compute_loss`: `_objective_loss`, plus the `labels` of chat rows (teacher-generated answers, -100
    outside them) so that only answer tokens count in the KL."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    return objective(**batch_inputs(batch), labels=labels)


def _record_adapter_base(peft_model, options: DistillOptions, trained_stage1: bool) -> None:
    """Make the adapter name the model it was trained on as its base (`base_model_name_or_path`).

    After stage 1 that is the stage-1 model folder of this run (at its final place, `output_dir/stage1/model`),
    not the converted `--student`: loading the adapter onto the student would drop what stage 1 learned."""
    if trained_stage1:
        base = Path(options.output_dir).resolve() / "stage1" / "model"
        for config in peft_model.peft_config.values():
            config.base_model_name_or_path = str(base)


def _save_distilled(model, tokenizer, folder: Path, options: DistillOptions, results: dict) -> None:
    """The merged model with its tokenizer, the conversion record and a card with the recipe and results."""
    
    save_model_and_tokenizer(model, tokenizer, folder)
    record_path = Path(options.student) / "conversion.json"
    if record_path.is_file():
        shutil.copy2(record_path, folder / "conversion.json")
        name = f"{Path(options.student).name}-distilled"
        card = distilled_card(json.loads(record_path.read_text()), results, name, options.eval_dataset)
        card.save(folder / "README.md")


def _write_results(out: Path, results: dict) -> None:
    """`results.json` and `report.md` (the perplexity table, then agreement with the teacher when measured)."""
    report = "# Distillation results\n\n" + results_table(results) + "\n"
    if "agreement" in results:
        report += "\n" + agreement_markdown(results["agreement"]) + "\n"
    for name, text in (("results.json", json.dumps(results, indent=1)), ("report.md", report)):
        write_text_atomically(out / name, text)
