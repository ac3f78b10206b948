"""`delta-attention distill STUDENT --output_dir OUT [...]`: attention transfer, then KL distillation with LoRA.

Runs on accelerate: `accelerate launch -m delta_attention.scripts.distill ...` for several processes.
"""

from __future__ import annotations

import sys

from delta_attention.conversion.data.text import DataOptions
from delta_attention.conversion.training import TrainingOptions
from delta_attention.conversion.training.distill import DistillOptions, run_distill
from delta_attention.conversion.training.lora import LoraOptions

Options = (DistillOptions, LoraOptions, DataOptions, TrainingOptions)


def run(options: DistillOptions, lora: LoraOptions, data: DataOptions, training: TrainingOptions) -> int:
    run_distill(options, data, training, lora)
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["distill", *sys.argv[1:]]))
