"""`delta-attention finetune MODEL --dataset DATA --output_dir OUT [--merge]`: LoRA fine-tuning of a delta model.

Plain text or chat data (a `messages` column, rendered with the tokenizer's chat template, loss on the
assistant turns by default). Several processes: `accelerate launch -m delta_attention.scripts.finetune ...`.
"""

from __future__ import annotations

import sys

from delta_attention.conversion.data.text import DataOptions
from delta_attention.conversion.training import TrainingOptions
from delta_attention.conversion.training.finetune import FinetuneOptions, run_finetune
from delta_attention.conversion.training.lora import LoraOptions

Options = (FinetuneOptions, LoraOptions, DataOptions, TrainingOptions)


def run(options: FinetuneOptions, lora: LoraOptions, data: DataOptions, training: TrainingOptions) -> int:
    summary = run_finetune(options, data, training, lora)
    print(f"fine-tuned {summary['tokens']:,} tokens, final loss {summary['final_loss']:.4f}; "
          f"adapter in {options.output_dir}/adapter")
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["finetune", *sys.argv[1:]]))
