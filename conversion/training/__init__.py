"""Training converted models: the shared accelerate loop and its checkpoints, LoRA options, the distillation
objectives and the `distill` and `finetune` jobs."""

from .loop import NonFiniteLossError, TrainingOptions, TrainingResult, run_training

__all__ = ["NonFiniteLossError", "TrainingOptions", "TrainingResult", "run_training"]
