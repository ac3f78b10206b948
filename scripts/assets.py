"""`delta-attention assets`: fetch the offline model (SmolLM2 GGUF) and text corpora into the cache folder."""

from __future__ import annotations

import dataclasses

from delta_attention.conversion.data.assets import cache_dir, documents, fetch_assets


@dataclasses.dataclass
class Options:
    home: str | None = dataclasses.field(
        default=None,
        metadata={"help": "assets folder (default: $DELTA_ATTENTION_HOME or ~/.cache/delta_attention)"},
    )
    force: bool = dataclasses.field(default=False, metadata={"help": "download again even if present"})


def run(options: Options) -> int:
    root = fetch_assets(options.home, force=options.force)
    train, heldout = documents("train", root), documents("heldout", root)
    print(f"text: {len(train)} training documents, {len(heldout)} held-out: "
          + ", ".join(d.name for d in heldout))
    return 0


__all__ = ["Options", "run", "cache_dir"]
