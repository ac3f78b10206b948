"""Model cards rendered from the templates in `model_cards/` with `huggingface_hub.ModelCard`."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

GATE_NAMES = {
    "none": "DeltaNet (no decay)",
    "scalar": "Gated DeltaNet (one decay per head)",
    "channel": "Kimi delta attention (one decay per key channel)",
}
LAYER_NAMES = {"full_attention": "softmax", "sliding_attention": "softmax (sliding window)",
               "linear_attention": "delta"}


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
        {"index": i, "source": LAYER_NAMES[s], "target": LAYER_NAMES[t]}
        for i, (s, t) in enumerate(zip(plan.source_types, plan.layer_types))
    ]
    ranking = None
    if plan.ranking:
        ranking = ", ".join(f"layer {i} ({ppl:.4g})" for i, ppl in plan.ranking)
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
        baseline_perplexity=f"{plan.baseline_perplexity:.4g}" if plan.baseline_perplexity else None,
        conv_kernel_size=config.linear_conv_kernel_size,
        output_gate="SiLU(g_proj x + 1.28), g_proj std 0.002" if config.linear_output_gate else "off",
        kv_groups=config.num_attention_heads // config.num_key_value_heads,
        qk_norm=config.use_qk_norm,
        calibration_summary=summary,
        layer_errors=_round_list(sorted(errors.items())) if errors else None,
        evaluation=result.evaluation_text(),
        memory_dtype=memory.dtype_name,
        memory_rows=memory.rows(),
        model_path=model_path,
        has_tokenizer=has_tokenizer,
    )


__all__ = ["conversion_card", "render", "template_path"]
