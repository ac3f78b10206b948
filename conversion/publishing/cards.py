"""Model cards rendered from the templates in `model_cards/` with `huggingface_hub.ModelCard`: the converted
model's card (`conversion_card`), the distilled model's (`distilled_card`, with `results_table`) and the merged
fine-tuned model's (`finetuned_card`)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from delta_attention.modeling.configuration_delta import DELTA_LAYER, delta_layer_indices

from ..evaluation.agreement import agreement_markdown

GATE_NAMES = {
    "none": "DeltaNet (no decay)",
    "scalar": "Gated DeltaNet (one decay per head)",
    "channel": "Kimi delta attention (one decay per key channel)",
}
LAYER_NAMES = {"full_attention": "softmax", "sliding_attention": "softmax (sliding window)", DELTA_LAYER: "delta"}


def template_path(name: str) -> Path:
    """A template from the installed `delta_attention.model_cards` data, or from the source tree."""
    try:
        resource = importlib.resources.files("delta_attention.model_cards") / name
        if resource.is_file():
            return Path(str(resource))
    except (ModuleNotFoundError, TypeError):
        pass
    local = Path(__file__).resolve().parent.parent / "model_cards" / name
    if local.is_file():
        return local
    raise FileNotFoundError(f"model card template {name!r} not found (package data delta_attention.model_cards)")


def render(template: str, card_data: ModelCardData, **fields) -> ModelCard:
    return ModelCard.from_template(card_data, template_path=str(template_path(template)), **fields)


def _round_list(values, digits=3) -> str:
    return ", ".join(f"{i}: {v:.{digits}g}" for i, v in values)


def conversion_card(result, model_path: str = ".", has_tokenizer: bool = True) -> ModelCard:
    """The card of a converted model (a `ConversionResult`)."""
    import transformers

    from delta_attention import __version__

    from ..converter.layer_plan import layer_name

    plan, settings, memory = result.plan, result.settings, result.memory
    ref = result.source_ref
    tags = ["delta-attention", "linear-attention", "converted", f"{settings.gate}-gate"]
    card_data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=tags,
        base_model=ref.path if ref is not None and ref.kind == "hub" else None,
    )
    config = result.model.config
    layer_rows = [
        {"index": i, "source": layer_name(s, plan.source_sliding_window), "target": layer_name(t, plan.sliding_window)}
        for i, (s, t) in enumerate(zip(plan.source_types, plan.layer_types))
    ]
    ranking = None
    if plan.ranking:
        ranking = ", ".join(f"layer {i} ({ppl:.4g})" for i, ppl in plan.ranking)
    induction = None
    if plan.induction is not None:
        induction = ", ".join(f"layer {i} ({score:.2f})" for i, score in plan.induction) or "none"
    errors = {i: c.error for i, c in result.calibration.items() if c.error is not None}
    summary = None
    if settings.init == "calibrated":
        summary = (
            f"{result.calibration_tokens:,} tokens of {result.calibration_text}; per-head (beta, decay) chosen from the "
            "attention-statistics prior and a grid by least squares, per-head output scale by least squares"
            + (f", then {settings.calibration_steps} per-layer steps" if settings.calibration_steps else "")
        )
    elif result.calibration_tokens:
        summary = f"{result.calibration_tokens:,} tokens of {result.calibration_text} (output RMSNorm statistics)"
    return render(
        "converted.md",
        card_data,
        model_name=Path(model_path).name or "Converted model",
        source_name=result.source_name,
        source_spec=ref.spec if ref is not None else result.source_name,
        source_kind={"hub": "Hub repository", "folder": "local folder", "gguf": "GGUF file"}.get(
            ref.kind if ref is not None else "", "in-memory model"),
        source_model_type=result.source_model_type,
        package_version=__version__,
        transformers_version=transformers.__version__,
        num_layers=len(plan.layer_types),
        num_delta=len(plan.delta),
        num_kept=len(plan.kept),
        gate=settings.gate,
        gate_name=GATE_NAMES[settings.gate],
        init=settings.init,
        trained=False,
        plan_rule=plan.rule,
        layer_rows=layer_rows,
        ranking=ranking,
        ranked_by="replaced alone by its delta layer" if plan.ranked_by == "conversion" else "bypassed",
        induction=induction,
        baseline_perplexity=f"{plan.baseline_perplexity:.4g}" if plan.baseline_perplexity else None,
        conv_kernel_size=config.linear_conv_kernel_size,
        output_gate="SiLU(g_proj x + 1.28), g_proj std 0.002" if config.linear_output_gate else "off",
        kv_groups=config.num_attention_heads // config.num_key_value_heads,
        gqa_state=config.linear_state_sharing == "kv_head",
        qk_norm=config.use_qk_norm,
        calibration_summary=summary,
        layer_errors=_round_list(sorted(errors.items())) if errors else None,
        evaluation=result.evaluation_text(),
        attention_window=plan.attention_window,
        memory_dtype=memory.dtype_name,
        memory_rows=memory.rows(),
        cache_bound=None if memory.converted_cache.bound is None else f"{memory.converted_cache.bound:,}",
        model_path=model_path,
        has_tokenizer=has_tokenizer,
    )


# ----------------------------------------------------------------------------------------------- distilled

EVAL_NAMES = {
    "builtin:heldout": ("held-out documents of the training corpora (State of the Union, Shakespeare, Brown Corpus, "
                        "Django's documentation)"),
    "builtin:crossdomain": "corpora of other domains and eras held out of training whole (e-mail, King James Bible)",
}


def _display(name: str | None) -> str | None:
    """A dataset as the card shows it: a local path only by its file name."""
    if name is None:
        return None
    return EVAL_NAMES.get(name) or (Path(name).name if Path(name).is_absolute() else name)


def _layers(indices) -> str:
    return ", ".join(map(str, indices)) or "none"


def distilled_card(conversion: dict, results: dict, model_name: str, eval_dataset: str):
    """A `ModelCard` for a distilled model; `conversion` is the converted folder's `conversion.json`."""
    source, plan, settings = conversion["source"], conversion["plan"], conversion["settings"]
    types = plan["layer_types"]
    stages = []
    if "stage1" in results:
        s1 = results["stage1"]
        stages.append({"name": "1: attention transfer", "tokens": f"{s1['tokens']:,}", "lr": s1["lr"],
                       "recipe": f"per-layer relative MSE to the teacher's attention output; trains the {s1['params']} "
                                 "delta parameters"})
    if "stage2" in results:
        s2 = results["stage2"]
        lora = s2["lora"]
        stages.append({"name": "2: logit distillation", "tokens": f"{s2['tokens']:,}",
                       "lr": f"{s2['lr']} (LoRA), {s2['new_params_lr']} (new parameters)",
                       "recipe": f"KL(teacher \\| student) at T={s2['temperature']}"
                                 + (f" + {s2['ce_weight']} CE" if s2["ce_weight"] else "")
                                 + f"; LoRA r={lora['r']}, alpha={lora['alpha']}, dropout={lora['dropout']} on "
                                   f"{lora['target_modules']}, merged"})
    if "stage3" in results:
        s3 = results["stage3"]
        stages.append({"name": "3: long-context distillation", "tokens": f"{s3['tokens']:,}",
                       "lr": f"{s3['lr']} (LoRA), {s3['new_params_lr']} (new parameters)",
                       "recipe": f"KL(teacher \\| student) at T={s3['temperature']} on {s3['seq_len']:,}-token blocks "
                                 f"({s3['packing']} packing), batch {s3['batch_size']}, logits in chunks of "
                                 f"{s3['logit_chunk']}" + (", gradient checkpointing" if s3["gradient_checkpointing"]
                                                           else "")})
    eval_name = _display(eval_dataset)
    final = (results.get("stage3") or results.get("stage2") or results.get("stage1") or {}).get("heldout_ppl")
    eval_results = None
    if final is not None:
        eval_results = [EvalResult(task_type="text-generation", dataset_type="text", dataset_name=eval_name,
                                   metric_type="perplexity", metric_value=round(final, 3))]
        final_crossdomain = (results.get("stage3") or results.get("stage2") or results.get("stage1")).get(
            "crossdomain_ppl")
        if final_crossdomain is not None:
            eval_results.append(EvalResult(task_type="text-generation", dataset_type="text",
                                           dataset_name=_display(results.get("crossdomain_dataset")),
                                           metric_type="perplexity", metric_value=round(final_crossdomain, 3)))
    hub_source = source.get("kind") == "hub"
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                         base_model=source["spec"] if hub_source else None, model_name=model_name,
                         eval_results=eval_results,
                         tags=["delta-attention", "linear-attention", "distilled", f"{settings['gate']}-gate"])
    memory = conversion.get("memory", {})
    recipe = results.get("recipe", {})
    return render(
        "distilled.md", data,
        model_name=model_name,
        source_name=source["spec"] if hub_source else Path(str(source["spec"])).name,
        model_type=source.get("model_type"),
        num_layers=len(types), num_delta=len(delta_layer_indices(types)),
        num_kept=len(types) - len(delta_layer_indices(types)),
        gate=settings["gate"], gate_name=GATE_NAMES[settings["gate"]], init=settings["init"],
        plan_rule=plan["rule"],
        kept_layers=_layers(i for i in range(len(types)) if i not in delta_layer_indices(types)),
        delta_layers=_layers(delta_layer_indices(types)),
        stages=stages, dataset=_display(recipe.get("dataset")), seq_len=recipe.get("seq_len"),
        batch_size=recipe.get("batch_size"), mixed_precision=recipe.get("mixed_precision"),
        eval_dataset=eval_name, results_table=results_table(results),
        agreement=agreement_markdown(dict(results["agreement"], dataset=_display(results["agreement"]["dataset"])),
                                     model_name, "teacher", level=3) if "agreement" in results else None,
        source_kv=f"{memory.get('source', {}).get('kv_per_token', 0):,}",
        converted_kv=f"{memory.get('converted', {}).get('kv_per_token', 0):,}",
        state_bytes=f"{memory.get('converted', {}).get('state_bytes', 0):,}",
        model_path=model_name,
    )


def results_table(results: dict) -> str:
    """Markdown table: teacher vs student held-out perplexity after each step of the recipe (every row scored in
    the precision `results["eval_precision"]` names, shown in the header), and beside it the cross-domain
    perplexity when it was measured (`teacher_crossdomain_ppl`, `crossdomain_ppl` of each stage)."""
    teacher, cross_teacher = results.get("teacher_ppl"), results.get("teacher_crossdomain_ppl")
    rows = [("teacher", teacher, cross_teacher),
            ("converted, untrained", results.get("converted_ppl"), results.get("converted_crossdomain_ppl"))]
    for stage in ("stage1", "stage2", "stage3"):
        if stage in results:
            rows.append((f"after {stage.replace('stage', 'stage ')} ({results[stage]['tokens']:,} tokens)",
                         results[stage].get("heldout_ppl"), results[stage].get("crossdomain_ppl")))
    precision = results.get("eval_precision")
    header = f"held-out perplexity ({precision})" if precision else "held-out perplexity"
    lines = [f"| model | {header} | vs teacher |", "|---|---|---|"]
    if cross_teacher is not None:
        lines = [lines[0] + " cross-domain perplexity | vs teacher |", lines[1] + "---|---|"]

    def cells(ppl, reference) -> str:
        if ppl is None:
            return " - | - |"
        return f" {ppl:.2f} | {ppl / reference:.2f}x |" if reference else f" {ppl:.2f} | - |"

    for name, ppl, cross in rows:
        if ppl is None:
            continue
        lines.append(f"| {name} |" + cells(ppl, teacher) + (cells(cross, cross_teacher) if cross_teacher else ""))
    if cross_teacher is not None:
        name = results.get("crossdomain_dataset")
        shown = f"`{name}`: {EVAL_NAMES[name]}" if name in EVAL_NAMES else f"`{_display(name)}`"
        lines += ["", f"Cross-domain perplexity on {shown}; never trained on."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- fine-tuned


def finetuned_card(model: str, dataset: str, summary: dict, seq_len: int | None = None) -> ModelCard:
    """A `ModelCard` for a merged fine-tuned model: `model` is the base given to `finetune`, `summary` its
    results (tokens, steps, final_loss, learning_rate, lora; `heldout_ppl` when measured)."""
    from ..converter.sources import looks_like_hub_id

    base_is_hub = not Path(model).exists() and looks_like_hub_id(model)
    base_name = model if base_is_hub else Path(model).name
    model_name = f"{base_name.split('/')[-1]}-finetuned"
    heldout = summary.get("heldout_ppl")
    eval_name = _display(summary.get("eval_dataset")) or "held-out text"
    eval_results = None
    if heldout is not None:
        eval_results = [EvalResult(task_type="text-generation", dataset_type="text", dataset_name=eval_name,
                                   metric_type="perplexity", metric_value=round(heldout, 3))]
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation",
                         base_model=model if base_is_hub else None, model_name=model_name, eval_results=eval_results,
                         tags=["delta-attention", "linear-attention", "fine-tuned", "lora"])
    loss = summary.get("final_loss")
    return render(
        "finetuned.md", data,
        model_name=model_name, base_name=base_name, base_is_hub=base_is_hub,
        dataset=_display(dataset), seq_len=seq_len, lora=summary["lora"],
        tokens=f"{summary['tokens']:,}", steps=summary["steps"], learning_rate=summary.get("learning_rate"),
        final_loss="-" if loss is None else f"{loss:.4g}",
        heldout=None if heldout is None else f"Perplexity on {eval_name} (not trained on): {heldout:.4g}",
        model_path=model_name,
    )


__all__ = ["conversion_card", "distilled_card", "finetuned_card", "render", "results_table", "template_path"]
