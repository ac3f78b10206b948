"""LoRA options shared by `distill` (stage 2) and `finetune`: one dataclass of flags and one `lora_config`.

A delta model has no default LoRA targets in PEFT (its `model_type` is custom), so every job names them; where
the user does not, the job's own default applies (`distill`: the copied attention projections; `finetune`:
every linear layer but the LM head).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class LoraOptions:
    """LoRA (PEFT) settings; `None` takes the job's default."""

    lora_r: int = dataclasses.field(default=16, metadata={"help": "LoRA rank"})
    lora_alpha: int = dataclasses.field(default=32, metadata={"help": "LoRA alpha"})
    lora_dropout: float | None = dataclasses.field(
        default=None, metadata={"help": "LoRA dropout (default: 0 for distill, 0.05 for finetune)"}
    )
    lora_target_modules: str | None = dataclasses.field(
        default=None,
        metadata={"help": "comma-separated module names, or all-linear (every linear but lm_head); default: "
                          "q_proj,k_proj,v_proj,o_proj for distill, all-linear for finetune"},
    )

    def validate(self) -> LoraOptions:
        if self.lora_r < 1:
            raise ValueError(f"--lora_r must be >= 1, got {self.lora_r}")
        if self.lora_dropout is not None and not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_target_modules is not None and not self.lora_target_modules.strip(", "):
            raise ValueError("--lora_target_modules is empty; name modules (e.g. q_proj,v_proj) or all-linear")
        return self

    def resolved(self, targets: str, dropout: float) -> LoraOptions:
        """These options with the job's defaults filled in."""
        return dataclasses.replace(
            self,
            lora_dropout=dropout if self.lora_dropout is None else self.lora_dropout,
            lora_target_modules=targets if self.lora_target_modules is None else self.lora_target_modules,
        )

    def record(self) -> dict:
        """What results files and cards say about the LoRA run."""
        return {"r": self.lora_r, "alpha": self.lora_alpha, "dropout": self.lora_dropout,
                "target_modules": self.lora_target_modules}


def lora_config(options: LoraOptions):
    """The `peft.LoraConfig` for resolved options (see `LoraOptions.resolved`)."""
    from peft import LoraConfig

    text = options.lora_target_modules
    targets = "all-linear" if text.strip() == "all-linear" else [t.strip() for t in text.split(",") if t.strip()]
    return LoraConfig(r=options.lora_r, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")


__all__ = ["LoraOptions", "lora_config"]
