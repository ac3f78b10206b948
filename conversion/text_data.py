"""Text data for distillation and fine-tuning, through `datasets`: load, tokenise, pack, shuffle by seed.

A data source is one of
* `"builtin:train"` / `"builtin:heldout"`: the project's offline corpora (`assets.py`), with its fixed
  held-out split (training never reads `builtin:heldout`);
* a local file or folder of `.txt`, `.jsonl`/`.json` or `.parquet` files;
* a Hub dataset name, optionally `name:config` (loaded with `datasets.load_dataset`).
Texts are tokenised, joined with the EOS token between documents and cut into blocks of `seq_len` tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import datasets

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclasses.dataclass
class DataOptions:
    """Where training text comes from and how it is cut into blocks."""

    dataset: str = dataclasses.field(
        default="builtin:train",
        metadata={"help": "builtin:train, a local txt/jsonl/parquet file or folder, or a Hub dataset name[:config]"},
    )
    dataset_split: str = dataclasses.field(default="train", metadata={"help": "split of a Hub/local dataset"})
    text_column: str = dataclasses.field(default="text", metadata={"help": "column holding the text"})
    seq_len: int = dataclasses.field(default=512, metadata={"help": "tokens per training block"})
    streaming: bool = dataclasses.field(default=False, metadata={"help": "stream the dataset instead of loading it"})
    shuffle_buffer: int = dataclasses.field(default=1000, metadata={"help": "blocks in the shuffle buffer when streaming"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the block order"})


def _looks_like_hub_name(source: str) -> bool:
    name = source.partition(":")[0]
    return name.count("/") <= 1 and not name.startswith((".", "/", "~")) and Path(name).suffix not in LOCAL_BUILDERS


def load_texts(source: str, split: str = "train", text_column: str = "text", streaming: bool = False):
    """A `datasets.Dataset` (or `IterableDataset` when streaming) with one column `text`."""
    if source.startswith("builtin:"):
        from .assets import heldout_texts, train_texts

        which = source.split(":", 1)[1]
        if which not in ("train", "heldout"):
            raise ValueError(f"unknown built-in corpus {source!r}; use 'builtin:train' or 'builtin:heldout'")
        texts = train_texts() if which == "train" else heldout_texts()
        dataset = datasets.Dataset.from_dict({"text": texts})
        return dataset.to_iterable_dataset() if streaming else dataset

    path = Path(source).expanduser()
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
        kinds = {LOCAL_BUILDERS.get(p.suffix) for p in files}
        if not files or None in kinds or len(kinds) != 1:
            raise ValueError(
                f"{source}: expected .txt, .jsonl/.json or .parquet files of one kind, found "
                f"{sorted({p.suffix for p in files}) or 'none'}"
            )
        builder = kinds.pop()
        options = {"sample_by": "document"} if builder == "text" else {}
        dataset = datasets.load_dataset(
            builder, data_files=[str(p) for p in files], split="train", streaming=streaming, **options
        )
    elif _looks_like_hub_name(source):
        name, _, config = source.partition(":")
        dataset = datasets.load_dataset(name, config or None, split=split, streaming=streaming)
    else:
        raise FileNotFoundError(f"{source}: no such file or folder (and not a Hub dataset name of the form owner/name)")

    if text_column not in (dataset.column_names or []):
        raise ValueError(
            f"{source}: no column {text_column!r} (columns: {dataset.column_names}); pass --text_column"
        )
    if text_column != "text":
        dataset = dataset.rename_column(text_column, "text")
    return dataset.select_columns(["text"])


def pack_blocks(texts, tokenizer, seq_len: int):
    """Tokenise `texts` (a Dataset/IterableDataset with `text`) and cut the token stream into `seq_len` blocks.

    Documents are joined with the tokenizer's EOS token; the remainder shorter than a block is dropped.
    Returns a dataset with one column `input_ids` (lists of `seq_len` ints).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize_and_pack(batch):
        stream = []
        for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + eos)
        usable = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i : i + seq_len] for i in range(0, usable, seq_len)]}

    # blocks never span two map batches; the remainder of each batch of 1,000 documents is dropped
    kwargs = {"batched": True, "batch_size": 1000, "remove_columns": ["text"]}
    if isinstance(texts, datasets.Dataset):
        kwargs["desc"] = "tokenizing"
    return texts.map(tokenize_and_pack, **kwargs)


def training_blocks(options: DataOptions, tokenizer):
    """Blocks for training: a `[N, seq_len]` LongTensor (the training loop draws them in a seeded order), or,
    when streaming, an `IterableDataset` shuffled through a buffer with `options.seed`."""
    import torch

    if options.dataset == "builtin:heldout":
        raise ValueError("builtin:heldout is the evaluation split; train on builtin:train or your own data")
    texts = load_texts(options.dataset, options.dataset_split, options.text_column, options.streaming)
    blocks = pack_blocks(texts, tokenizer, options.seq_len)
    if options.streaming:
        return blocks.shuffle(seed=options.seed, buffer_size=options.shuffle_buffer)
    if len(blocks) == 0:
        raise ValueError(f"{options.dataset}: not enough text for one block of {options.seq_len} tokens")
    return torch.tensor(blocks["input_ids"][:], dtype=torch.long)
