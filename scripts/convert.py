"""`delta-attention convert SOURCE --out DIR ...`: turn softmax-attention layers of a checkpoint into delta attention.

SOURCE is a Hub id, a local folder or a `.gguf` file (Llama, Mistral, Qwen2/2.5, Qwen3 families).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from delta_attention.conversion.converter.pipeline import ConversionSettings, convert


@dataclasses.dataclass
class ConvertOptions:
    """What to convert and where to write it; how to convert is `ConversionSettings`."""

    source: str = dataclasses.field(
        default=None,
        metadata={"positional": True, "help": "Hub id, local folder or .gguf file to convert (may be the first argument)"},
    )
    out: str | None = dataclasses.field(default=None, metadata={"help": "output folder (written atomically)"})
    calibration_text: str | None = dataclasses.field(
        default=None,
        metadata={"help": "a .txt file or a folder of .txt files to calibrate on (default: the assets' training text)"},
    )
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


Options = (ConvertOptions, ConversionSettings)


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


def run(options: ConvertOptions, settings: ConversionSettings) -> int:
    if not options.source:
        raise ValueError("give SOURCE: a Hub id, a local folder or a .gguf file")
    texts = read_texts(options.calibration_text) if options.calibration_text else None
    convert(
        options.source,
        options.out,
        settings,
        overwrite=options.overwrite,
        force_overwrite=options.force_overwrite,
        tokenizer=options.tokenizer,
        dry_run=options.dry_run,
        calibration_texts=texts,
        progress=not options.quiet,
    )
    return 0


__all__ = ["ConvertOptions", "Options", "run"]
