"""`delta-attention assets`: fetch the offline model (SmolLM2 GGUF) and text corpora into the cache folder."""

from __future__ import annotations

import dataclasses

from delta_attention.conversion.data.assets import CORPORA, cache_dir, documents, fetch_assets


@dataclasses.dataclass
class Options:
    home: str | None = dataclasses.field(
        default=None,
        metadata={"help": "assets folder (default: $DELTA_ATTENTION_HOME or ~/.cache/delta_attention)"},
    )
    force: bool = dataclasses.field(default=False, metadata={"help": "download again even if present"})


def run(options: Options) -> int:
    root = fetch_assets(options.home, force=options.force)
    for item in CORPORA:
        if item.role == "train":
            train, heldout = documents("train", root, [item.name]), documents("heldout", root, [item.name])
            print(f"{item.name}: {len(train)} training documents (weight {item.weight:g} of builtin:train), "
                  f"{len(heldout)} held out: "
                  + ", ".join(d.name for d in heldout))
        else:
            print(f"{item.name}: {len(documents('crossdomain', root, [item.name]))} documents, held out whole "
                  "(builtin:crossdomain)")
    return 0


__all__ = ["Options", "run", "cache_dir"]
