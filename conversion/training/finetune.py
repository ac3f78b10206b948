"""`finetune`: LoRA (PEFT) supervised fine-tuning of a delta model on plain text or chat data.

Runs on the shared training loop (`training.py`): same accelerate set-up, checkpoints, resume, progress and
metrics as `distill`. Writes `output_dir/adapter` (loadable with `PeftModel.from_pretrained` or
`AutoPeftModelForCausalLM.from_pretrained(..., trust_remote_code=True)`) and, with `--merge`,
`output_dir/merged`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..data.chat import chat_rows
from ..data.text import DataOptions, load_texts, training_blocks, warn_if_longer_than_model
from ..loading import check_model_spec, load_model
from ..output_folder import check_output_folder, on_main_process, open_run_folder_once
from ..saving import atomic_save, save_model_and_tokenizer
from .frozen_casts import FrozenLinearCasts
from .lora import LoraOptions, lora_config
from .loop import TrainingOptions, run_training
from .metrics import plot_metrics


@dataclasses.dataclass
class FinetuneOptions:
    """What to fine-tune and how."""

    model: str = dataclasses.field(default=None, metadata={"help": "delta model folder or Hub id", "positional": True})
    output_dir: str = dataclasses.field(default="finetuned", metadata={"help": "run folder"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output_dir (a run of this tool) once the new run is done"}
    )
    force_overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "with --overwrite: replace output_dir even if this tool did not write it"}
    )
    data_format: str = dataclasses.field(
        default="auto", metadata={"help": "text, chat (a `messages` column), or auto (chat when it has `messages`)"}
    )
    messages_column: str = dataclasses.field(default="messages", metadata={"help": "column of chat conversations"})
    completion_only_loss: bool = dataclasses.field(
        default=True, metadata={"help": "chat data: loss on the assistant turns only"}
    )
    max_tokens: int = dataclasses.field(default=200_000, metadata={"help": "token budget (padding included)"})
    learning_rate: float = dataclasses.field(default=2e-4, metadata={"help": "learning rate of the LoRA weights"})
    merge: bool = dataclasses.field(default=False, metadata={"help": "also write the merged model to output_dir/merged"})


def _check_options(options: FinetuneOptions, data: DataOptions, training: TrainingOptions) -> None:
    """Every check that needs no model: options, the model folder, the output folder."""
    if not options.model:
        raise ValueError("give the model: delta-attention finetune MODEL --dataset DATA --output_dir OUT")
    check_model_spec(options.model)
    if options.data_format not in ("auto", "text", "chat"):
        raise ValueError(f"--data_format must be auto, text or chat, got {options.data_format!r}")
    if options.max_tokens < 1:
        raise ValueError(f"--max_tokens must be >= 1, got {options.max_tokens}")
    training.validate()
    data.validate()
    check_output_folder(options.output_dir, overwrite=options.overwrite, resume=training.resume,
                        force=options.force_overwrite, inputs=(options.model, data.dataset))


def finetune_rows(options: FinetuneOptions, data: DataOptions, tokenizer):
    """Training rows: a tensor of packed text blocks, or a dict of chat tensors with completion-only labels."""
    fmt = options.data_format
    if fmt != "text":
        column = options.messages_column
        table = None
        if fmt == "chat":
            table = load_texts(data.dataset, data.dataset_split, column, data.streaming, column_flag="--messages_column")
        if fmt == "auto":
            try:
                table = load_texts(data.dataset, data.dataset_split, column, data.streaming)
                fmt = "chat"
            except ValueError:
                fmt = "text"
    if fmt == "text":
        return training_blocks(data, tokenizer)
    return chat_rows(tokenizer, (row["text"] for row in table), data.seq_len, options.completion_only_loss)


def _loss_with_frozen_casts(casts: FrozenLinearCasts):
    """`_loss` with the model's frozen linear weights (the base weights under LoRA, the LM head) cast to the autocast
    dtype once for the whole run (`casts`), not at every step: the same loss and gradients."""

    def loss(model, batch):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        with casts.cast_in(model, device_type=ids.device.type):
            return _loss(model, batch)

    return loss


def _loss(model, batch):
    """Causal LM loss. Packed text with `position_ids` (documents restart at 0): the first token of a document is
    not a target, as with transformers' `DataCollatorWithFlattening`; chat rows bring their own labels."""
    if not isinstance(batch, dict):
        return model(input_ids=batch, labels=batch, use_cache=False).loss, {}
    if "labels" not in batch:
        labels = batch["input_ids"].clone()
        if "position_ids" in batch:
            labels[batch["position_ids"] == 0] = -100
        batch = {**batch, "labels": labels}
    return model(**batch, use_cache=False).loss, {}


#: LoRA unless the options say otherwise: every linear layer but the LM head, dropout 0.05
FINETUNE_LORA_TARGETS, FINETUNE_LORA_DROPOUT = "all-linear", 0.05


def run_finetune(options: FinetuneOptions, data: DataOptions, training: TrainingOptions,
                 lora: LoraOptions | None = None) -> dict:
    """Fine-tune with LoRA; returns a summary (also written to `output_dir/results.json`)."""
    from peft import get_peft_model

    _check_options(options, data, training)
    lora = (lora or LoraOptions()).validate().resolved(FINETUNE_LORA_TARGETS, FINETUNE_LORA_DROPOUT)
    model, tokenizer = load_model(options.model)
    warn_if_longer_than_model(data.seq_len, model.config)
    rows = finetune_rows(options, data, tokenizer)
    run = open_run_folder_once(Path(options.output_dir), "finetune", overwrite=options.overwrite,
                               resume=training.resume)
    out = run.work
    torch.manual_seed(data.seed)  # the LoRA initialisation: the same --seed gives the same run
    peft_model = get_peft_model(model, lora_config(lora))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    result = run_training(peft_model, _loss_with_frozen_casts(FrozenLinearCasts()),
                          [{"params": params, "lr": options.learning_rate}], rows, training, out,
                          options.max_tokens, seed=data.seed, description="fine-tuning")
    # under `accelerate launch` every process runs this; only the main one writes
    on_main_process(atomic_save, lambda folder: save_model_and_tokenizer(peft_model, tokenizer, folder), out / "adapter")
    summary = {"model": options.model, "steps": result.steps, "tokens": result.tokens, "final_loss": result.final_loss,
               "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
               "lora": lora.record(), "learning_rate": options.learning_rate}
    if options.merge:
        from ..publishing.cards import finetuned_card

        merged = peft_model.merge_and_unload()
        card = finetuned_card(options.model, data.dataset, summary, seq_len=data.seq_len)
        on_main_process(atomic_save, lambda folder: (save_model_and_tokenizer(merged, tokenizer, folder),
                                                     card.save(Path(folder) / "README.md")), out / "merged")
    on_main_process((out / "results.json").write_text, json.dumps(summary, indent=1))
    on_main_process(plot_metrics, {"fine-tuning": result.metrics_path}, out / "metrics.png",
                    title=f"fine-tuning {options.model}")
    on_main_process(run.finish)
    return summary
