"""The model card of a distilled model: the conversion (from `conversion.json`), the recipe and the results."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCardData

from .card import GATE_NAMES, render

EVAL_NAMES = {"builtin:heldout": "held-out State of the Union and Shakespeare text"}


def _display(name: str | None) -> str | None:
    """A dataset as the card shows it: a local path only by its file name."""
    if name is None:
        return None
    return EVAL_NAMES.get(name) or (Path(name).name if Path(name).is_absolute() else name)


def _layers(indices) -> str:
    return ", ".join(map(str, indices)) or "none"


def distilled_card(conversion: dict, results: dict, model_name: str, eval_dataset: str):
    """A `ModelCard` for a distilled model; `conversion` is the converted folder's `conversion.json`."""
    from .distill_pipeline import results_table

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
    eval_name = _display(eval_dataset)
    final = (results.get("stage2") or results.get("stage1") or {}).get("heldout_ppl")
    eval_results = None
    if final is not None:
        eval_results = [EvalResult(task_type="text-generation", dataset_type="text", dataset_name=eval_name,
                                   metric_type="perplexity", metric_value=round(final, 3))]
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
        num_layers=len(types), num_delta=types.count("linear_attention"),
        num_kept=len(types) - types.count("linear_attention"),
        gate=settings["gate"], gate_name=GATE_NAMES[settings["gate"]], init=settings["init"],
        plan_rule=plan["rule"],
        kept_layers=_layers(i for i, t in enumerate(types) if t != "linear_attention"),
        delta_layers=_layers(i for i, t in enumerate(types) if t == "linear_attention"),
        stages=stages, dataset=_display(recipe.get("dataset")), seq_len=recipe.get("seq_len"),
        batch_size=recipe.get("batch_size"), mixed_precision=recipe.get("mixed_precision"),
        eval_dataset=eval_name, results_table=results_table(results),
        source_kv=f"{memory.get('source', {}).get('kv_per_token', 0):,}",
        converted_kv=f"{memory.get('converted', {}).get('kv_per_token', 0):,}",
        state_bytes=f"{memory.get('converted', {}).get('state_bytes', 0):,}",
        model_path=model_name,
    )
