"""`delta-attention convert SOURCE --out DIR ...`: turn softmax-attention layers of a checkpoint into delta attention.

SOURCE is a Hub id, a local folder or a `.gguf` file (Llama, Mistral, Qwen2/2.5, Qwen3 families).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from delta_attention.conversion.convert import ConversionSettings, convert


@dataclasses.dataclass
class Options:
    source: str = dataclasses.field(
        default=None,
        metadata={"positional": True, "help": "Hub id, local folder or .gguf file to convert (may be the first argument)"},
    )
    out: str | None = dataclasses.field(default=None, metadata={"help": "output folder (written atomically)"})
    keep_attention: str = dataclasses.field(
        default="0.25",
        metadata={"help": "layers that stay softmax: all | none | 0,4,8 | a ratio like 0.25 (uniform from layer 0) | "
                          "auto:<ratio> (rank layers by the perplexity cost of bypassing them)"},
    )
    keep_first_layer: bool = dataclasses.field(
        default=True, metadata={"help": "auto: always keep layer 0 as softmax (--no-keep-first-layer to rank it too)"}
    )
    gate: str = dataclasses.field(
        default="scalar", metadata={"help": "delta decay: none (DeltaNet) | scalar (Gated DeltaNet) | channel (KDA)"}
    )
    init: str = dataclasses.field(
        default="calibrated",
        metadata={"help": "copy (weights copied, fixed defaults) | calibrated (fitted to the source's attention)"},
    )
    calibration_tokens: int = dataclasses.field(default=4096, metadata={"help": "tokens of calibration text"})
    calibration_seq_len: int = dataclasses.field(default=512, metadata={"help": "length of a calibration window"})
    calibration_steps: int = dataclasses.field(
        default=0, metadata={"help": "calibrated init: Adam steps per delta layer on the teacher's attention output"}
    )
    calibration_lr: float = dataclasses.field(default=3e-3, metadata={"help": "learning rate of those steps"})
    calibration_text: str | None = dataclasses.field(
        default=None,
        metadata={"help": "a .txt file or a folder of .txt files to calibrate on (default: the assets' training text)"},
    )
    rank_tokens: int = dataclasses.field(default=2048, metadata={"help": "auto: tokens of text to rank layers on"})
    conv_kernel_size: int = dataclasses.field(default=4, metadata={"help": "short conv kernel of delta layers (0 = off)"})
    output_gate: bool = dataclasses.field(default=True, metadata={"help": "delta output gate (--no-output-gate: off)"})
    allow_neg_eigval: bool = dataclasses.field(default=False, metadata={"help": "beta in (0, 2) instead of (0, 1)"})
    bf16: bool = dataclasses.field(default=True, metadata={"help": "bf16 autocast for calibration and ranking"})
    dtype: str = dataclasses.field(default="auto", metadata={"help": "saved weights: auto (source dtype) | float32 | bfloat16 | float16"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the new parameters' random parts"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output folder that delta-attention wrote"}
    )
    force_overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "with --overwrite: replace the output folder even if this tool did not write it"}
    )
    tokenizer: bool = dataclasses.field(
        default=True, metadata={"help": "load and save the source's tokenizer (--no_tokenizer: convert without one)"}
    )
    dry_run: bool = dataclasses.field(
        default=False, metadata={"help": "print the plan (layer map, parameters, state vs KV bytes); write nothing"}
    )
    quiet: bool = dataclasses.field(default=False, metadata={"help": "no progress bars"})


def read_texts(path: str) -> list[str]:
    """The texts of a .txt file, or of every .txt file in a folder (sorted by name)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p.read_text(encoding="utf-8", errors="replace")]
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if files:
            return [f.read_text(encoding="utf-8", errors="replace") for f in files]
        raise FileNotFoundError(f"no .txt files in {path}")
    raise FileNotFoundError(f"calibration text not found: {path}")


def settings_from(options: Options) -> ConversionSettings:
    names = {f.name for f in dataclasses.fields(ConversionSettings)}
    return ConversionSettings(**{k: v for k, v in dataclasses.asdict(options).items() if k in names})


def run(options: Options) -> int:
    if not options.source:
        raise ValueError("give SOURCE: a Hub id, a local folder or a .gguf file")
    texts = read_texts(options.calibration_text) if options.calibration_text else None
    convert(
        options.source,
        options.out,
        settings_from(options),
        overwrite=options.overwrite,
        force_overwrite=options.force_overwrite,
        tokenizer=options.tokenizer,
        dry_run=options.dry_run,
        calibration_texts=texts,
        progress=not options.quiet,
    )
    return 0


__all__ = ["Options", "run"]
