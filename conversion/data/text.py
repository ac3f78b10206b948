"""Text data for distillation and fine-tuning, through `datasets`: load, tokenise, pack, shuffle by seed.

A data source is one of
* a built-in set of the project's offline corpora (`assets.py`): `builtin:train` (the training corpora mixed by
  their default weights, or `builtin:train:sotu=0.5,brown=0.5` for another mix), and the evaluation sets that
  training never reads: `builtin:heldout` (the fixed held-out documents of the training corpora),
  `builtin:crossdomain` (the corpora held out whole) and `builtin:heldout:<corpus>[,<corpus>...]` (some corpora's
  part of those);
* a local file or folder of `.txt`, `.jsonl`/`.json` or `.parquet` files;
* a Hub dataset name, optionally `name:config` (loaded with `datasets.load_dataset`);
* `generated:OUT`, the samples `generate-data` wrote (`generated.py`);
* `quote:SOURCE`, chat turns that copy passages of SOURCE back (`quotes.py`);
* mixes of sources by weight, `builtin:train@0.5+generated:OUT@0.5` (`generated.mixed_rows`).
Texts are tokenised, joined with the EOS token between documents and cut into blocks of `seq_len` tokens.
With `packing="boundary"` (the default) every block comes with `position_ids` that restart at 0 after each EOS
(a document cut by a block boundary starts its block at 0 too), as transformers' `DataCollatorWithFlattening`
produces, so that a model which reads document boundaries from restarting positions keeps the documents apart.

Bad input fails with one `ValueError` or `FileNotFoundError` whose message names the file (and line) and the
fix. Local files are checked before `datasets` reads them (`.txt` lines are UTF-8, each `.jsonl` line is one
JSON object, a `.json` file is one document, a `.parquet` footer reads), and an unreachable Hub dataset says
that the machine may be offline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import datasets

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
PACKINGS = ("boundary", "plain")
LOCAL_HINT = "pass --dataset a local .txt/.jsonl/.parquet file or folder, or builtin:train"


@dataclasses.dataclass
class DataOptions:
    """Where training text comes from and how it is cut into blocks."""

    dataset: str = dataclasses.field(
        default="builtin:train",
        metadata={"help": "builtin:train[:CORPUS=WEIGHT,...], a local txt/jsonl/parquet file or folder, or a Hub "
                          "dataset name[:config]; generated:OUT (samples of generate-data); quote:SOURCE (chat turns "
                          "copying passages of SOURCE); a mix A@0.7+B@0.3"},
    )
    dataset_split: str = dataclasses.field(default="train", metadata={"help": "split of a Hub/local dataset"})
    text_column: str = dataclasses.field(default="text", metadata={"help": "column holding the text"})
    seq_len: int = dataclasses.field(default=512, metadata={"help": "tokens per training block"})
    streaming: bool = dataclasses.field(default=False, metadata={"help": "stream the dataset instead of loading it"})
    shuffle_buffer: int = dataclasses.field(default=1000, metadata={"help": "blocks in the shuffle buffer when streaming"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the block order"})
    packing: str = dataclasses.field(
        default="boundary",
        metadata={"help": "boundary: position ids restart at 0 after each EOS (documents kept apart); "
                          "plain: one run of positions per block"},
    )

    def validate(self) -> DataOptions:
        """Raise a `ValueError` naming the flag when an option cannot work (before any data is read)."""
        if not str(self.dataset).strip():
            raise ValueError("--dataset is empty; give builtin:train, a local .txt/.jsonl/.parquet file or folder, "
                             "or a Hub dataset name")
        if self.seq_len < 2:
            raise ValueError(f"--seq_len must be at least 2 (each block predicts its tokens from the ones before), "
                             f"got {self.seq_len}")
        if self.packing not in PACKINGS:
            raise ValueError(f"--packing must be one of {', '.join(PACKINGS)}, got {self.packing!r}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"--shuffle_buffer must be at least 1 (1 keeps the file order), got {self.shuffle_buffer}")
        from .generated import check_sources

        check_sources(self.dataset)  # each source of a mix `A@w+B@v`: check_trainable, generated: folders
        return self


def warn_if_longer_than_model(seq_len: int, config) -> bool:
    """Print one warning line when `seq_len` exceeds the model config's `max_position_embeddings`.

    Returns whether it warned. A config without the field (or a dict without the key) never warns.
    """
    if isinstance(config, dict):
        limit = config.get("max_position_embeddings")
    else:
        limit = getattr(config, "max_position_embeddings", None)
        if limit is None and hasattr(config, "get_text_config"):
            limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int) or seq_len <= limit:
        return False
    print(f"warning: --seq_len {seq_len} is longer than the model's max_position_embeddings ({limit}); positions "
          f"past {limit} were never trained and quality may suffer (use --seq_len {limit} or less)", file=sys.stderr)
    return True


def _looks_like_hub_name(source: str) -> bool:
    name = source.partition(":")[0]
    return name.count("/") <= 1 and not name.startswith((".", "/", "~")) and Path(name).suffix not in LOCAL_BUILDERS


def _first_line(error: BaseException) -> str:
    """`Type: first line of the message` of the root cause of `error` (following `raise ... from`)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _bad_json(path: Path, number: int, error: ValueError) -> ValueError:
    detail = f"column {error.colno}: {error.msg}" if isinstance(error, json.JSONDecodeError) else str(error)
    return ValueError(f"{path}: line {number} is not valid JSON ({detail}); fix or delete that line")


def _check_jsonl(path: Path) -> bool:
    """Raise a `ValueError` naming the first line (from 1) of `path` that is not one JSON object.

    Returns whether the file holds at least one object.
    """
    found = False
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line.rstrip())
            except ValueError as error:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
                raise _bad_json(path, number, error) from None
            if not isinstance(value, dict):
                raise ValueError(f"{path}: line {number} is JSON but not an object (got {type(value).__name__}); "
                                 'each line of a .jsonl file must be one object such as {"text": "..."}')
            found = True
    return found


def _check_text(path: Path) -> bool:
    """Raise a `ValueError` naming the first line (from 1) of `path` that is not UTF-8. Returns True."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}: line {number} is not UTF-8 text ({error.reason} at byte {error.start}); "
                                 f"save the file as UTF-8") from None
    return True


def _check_json(path: Path) -> bool:
    """Raise a `ValueError` naming `path` unless it is one JSON document or JSON Lines. Returns whether it has data."""
    data = path.read_bytes()
    if not data.strip():
        return False
    try:
        value = json.loads(data)
    except ValueError as error:
        whole = error
    else:
        if not isinstance(value, (list, dict)):
            raise ValueError(f"{path}: the JSON document must be a list of objects such as "
                             f'[{{"text": "..."}}] (or use JSON Lines, .jsonl), not {type(value).__name__}')
        return bool(value)
    first = next(line for line in data.splitlines() if line.strip())
    try:
        json.loads(first)
    except ValueError:
        detail = f"line {whole.lineno}, column {whole.colno}: {whole.msg}" if isinstance(
            whole, json.JSONDecodeError) else str(whole)
        raise ValueError(f"{path}: not valid JSON ({detail}); fix the file or save it as JSON Lines (.jsonl)") from None
    return _check_jsonl(path)  # JSON Lines saved as .json: name the first bad line


def _check_parquet(path: Path) -> bool:
    """Raise a `ValueError` naming `path` when its Parquet footer cannot be read. Returns whether it has rows."""
    import pyarrow
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_metadata(path).num_rows > 0
    except (pyarrow.ArrowException, OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({_first_line(error)}); re-export it, "
                         f"or use a .jsonl or .txt file") from None


def _check_local_files(source: str, builder: str, files: list[Path]) -> None:
    """Check the files before `datasets` reads them; a clear error names the file (and line)."""
    checks = {".txt": _check_text, ".jsonl": _check_jsonl, ".json": _check_json, ".parquet": _check_parquet}
    has_data = [checks[p.suffix](p) for p in files]
    if not any(has_data):
        suffixes = "/".join(sorted({p.suffix for p in files}))
        raise ValueError(f"{source}: no rows (every {suffixes} file is empty); add data, or {LOCAL_HINT}")


def _load_local(source: str, path: Path, streaming: bool):
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
    kinds = {LOCAL_BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds or len(kinds) != 1:
        raise ValueError(
            f"{source}: expected .txt, .jsonl/.json or .parquet files of one kind, found "
            f"{sorted({p.suffix for p in files}) or 'none'}"
        )
    builder = kinds.pop()
    _check_local_files(source, builder, files)
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(
            builder, data_files=[str(p) for p in files], split="train", streaming=streaming, **options
        )
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError) as error:
        # what the checks above cannot see, e.g. a Parquet file whose footer reads but whose pages do not
        raise ValueError(f"{source}: could not be read as {builder} data ({_first_line(error)})") from error


def _load_hub(source: str, split: str, streaming: bool):
    name, _, config = source.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split, streaming=streaming)
    except OSError as error:  # ConnectionError, DatasetNotFoundError, HTTP errors: all OSErrors
        offline = " (HF_HUB_OFFLINE is set)" if datasets.config.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"{source}: not a local file or folder, and the Hub dataset {name!r} could not be reached "
            f"({_first_line(error)}); this machine may be offline{offline}, or the name is wrong or private. "
            f"Fix: {LOCAL_HINT}"
        ) from error


BUILTIN_SETS = ("builtin:train[:CORPUS=WEIGHT,...], builtin:heldout, builtin:crossdomain or "
                "builtin:heldout:CORPUS[,CORPUS...]")


def _builtin_weights(source: str, text: str) -> dict[str, float]:
    """`sotu=0.5,brown=0.5` (a bare name weighs 1) as a dict; a `ValueError` names a weight that is no number."""
    weights = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, _, weight = entry.partition("=")
        try:
            weights[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"{source}: the weight of {name.strip()!r} is not a number ({weight!r}); write "
                             f"builtin:train:sotu=0.5,brown=0.5") from None
    return weights


def _builtin_parts(source: str) -> tuple[str, str]:
    """The set and the rest of a `builtin:SET[:REST]` source: `builtin:train:sotu=1` -> ("train", "sotu=1")."""
    _, which, rest = (source.split(":", 2) + ["", ""])[:3]
    return which, rest


def builtin_train_mix(source: str) -> dict[str, float] | None:
    """The normalised corpus weights a `builtin:train[:...]` source trains on (the default mix for `builtin:train`),
    so that two spellings of one mix compare equal; None for any other source."""
    from . import assets

    if not source.startswith("builtin:"):
        return None
    which, rest = _builtin_parts(source)
    if which != "train":
        return None
    return assets.check_train_weights(_builtin_weights(source, rest) if rest else dict(assets.TRAIN_WEIGHTS))


def builtin_documents(source: str) -> list:
    """The `assets.Document`s of a built-in set (see the module docstring), in a fixed order.

    Training sets are `assets.training_documents`; the evaluation sets never share a document with them."""
    from . import assets

    which, rest = _builtin_parts(source)
    if which == "train":
        return assets.training_documents(_builtin_weights(source, rest) if rest else None)
    if which in ("heldout", "crossdomain") and not rest:
        return assets.documents(which)
    if which == "heldout":  # one corpus's evaluation part, or several: builtin:heldout:sotu,brown
        names = list(dict.fromkeys(n.strip() for n in rest.split(",") if n.strip()))
        if not names:
            raise ValueError(f"{source} names no corpus; use {BUILTIN_SETS}")
        docs = []
        for name in names:
            item = assets.corpus(name)
            docs += assets.documents("crossdomain" if item.role == "crossdomain" else "heldout", corpora=[item.name])
        return docs
    raise ValueError(f"unknown built-in set {source!r}; use {BUILTIN_SETS}")


def source_list(text: str) -> list[str]:
    """Split a comma-separated list of sources, keeping a `builtin:heldout:A,B` corpus list whole.

    `builtin:heldout:sotu,brown,builtin:crossdomain` -> ["builtin:heldout:sotu,brown", "builtin:crossdomain"]: a part
    that names a built-in corpus right after a `builtin:heldout:` part continues that part's list."""
    from . import assets

    names = {item.name for item in assets.CORPORA}
    sources = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in names and sources and sources[-1].startswith("builtin:heldout:"):
            sources[-1] += "," + part
        else:
            sources.append(part)
    return sources


def check_trainable(source: str) -> None:
    """Raise a `ValueError` when `source` is a built-in evaluation set (held-out and cross-domain text never
    reaches training), an unknown built-in set, or a `builtin:train` mix naming a corpus it may not train on."""
    if not source.startswith("builtin:"):
        return
    from .assets import check_train_weights

    which, rest = _builtin_parts(source)
    if which in ("heldout", "crossdomain"):
        raise ValueError(f"{source} is the evaluation split (never trained on); train on builtin:train or your own "
                         "data")
    if which != "train":
        raise ValueError(f"unknown built-in set {source!r}; use {BUILTIN_SETS}")
    if rest:
        check_train_weights(_builtin_weights(source, rest))


def load_texts(source: str, split: str = "train", text_column: str = "text", streaming: bool = False,
               column_flag: str = "--text_column"):
    """A `datasets.Dataset` (or `IterableDataset` when streaming) with one column `text` (from `text_column`).

    `column_flag` is the command-line flag that names `text_column`, for the error when the column is missing
    (`--messages_column` when loading chat conversations).
    """
    if source.startswith("generated:"):  # teacher-generated samples: the chat or text shards of the folder
        from .generated import generated_subfolder

        source = generated_subfolder(source, text_column)
    path = Path(source).expanduser()
    if source.startswith("builtin:"):
        dataset = datasets.Dataset.from_dict({"text": [d.text for d in builtin_documents(source)]})
        dataset = dataset.to_iterable_dataset() if streaming else dataset
    elif path.exists():
        dataset = _load_local(source, path, streaming)
    elif _looks_like_hub_name(source):
        dataset = _load_hub(source, split, streaming)
    else:
        raise FileNotFoundError(f"{source}: no such file or folder (and not a Hub dataset name of the form owner/name)")

    columns = dataset.column_names
    if columns is None:  # a stream whose features are only known once read (e.g. streamed .txt files)
        columns = list(next(iter(dataset), {}))
    if text_column not in columns:
        raise ValueError(f"{source}: no column {text_column!r} (columns: {columns}); pass {column_flag} "
                         f"with the column to use")
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

    def tokenize_and_pack(batch, indices):
        for row, text in zip(indices, batch["text"]):
            if not isinstance(text, str):
                raise ValueError(f"row {row} (counted from 0) holds a {type(text).__name__}, not text "
                                 f"({str(text)[:40]!r}); pass --text_column with a column of strings")
        stream = []
        for ids in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + eos)
        usable = len(stream) // seq_len * seq_len
        return {"input_ids": [stream[i : i + seq_len] for i in range(0, usable, seq_len)]}

    # blocks never span two map batches; the remainder of each batch of 1,000 documents is dropped
    kwargs = {"batched": True, "batch_size": 1000, "remove_columns": ["text"], "with_indices": True}
    if isinstance(texts, datasets.Dataset):
        kwargs["desc"] = "tokenizing"
    return texts.map(tokenize_and_pack, **kwargs)


#: the format of the tokenized-corpus cache (`cached_blocks`); a new number leaves every older entry unread
TOKEN_CACHE_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A hash of what decides a tokenizer's ids (its serialised fast tokenizer, class and EOS token), or None for
    a tokenizer that cannot be serialised so (its blocks are then never cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    digest = hashlib.sha256(backend.to_str().encode())
    digest.update(repr((type(tokenizer).__name__, tokenizer.eos_token_id)).encode())
    return digest.hexdigest()


def token_cache_dir() -> Path:
    """Where `cached_blocks` keeps tokenized corpora: `tokenized/` in the assets folder (`assets.cache_dir`)."""
    from .assets import cache_dir

    return cache_dir() / "tokenized"


def cached_blocks(texts, tokenizer, seq_len: int):
    """`pack_blocks(texts, tokenizer, seq_len)`'s `input_ids` as an `[N, seq_len]` LongTensor, kept on disk
    (`token_cache_dir()`, safetensors) under a hash of the texts, the tokenizer (`tokenizer_fingerprint`), `seq_len`
    and `TOKEN_CACHE_VERSION`, so a later run over the same corpus skips the tokenizer; another corpus or tokenizer
    gives another entry. An unreadable entry is made again."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save

    from ..saving import write_bytes_atomically

    fingerprint = tokenizer_fingerprint(tokenizer)
    path = None
    if fingerprint is not None:
        digest = hashlib.sha256(f"{TOKEN_CACHE_VERSION}:{fingerprint}:{seq_len}:".encode())
        for text in texts["text"]:
            encoded = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else repr(text).encode()
            digest.update(f"{len(encoded)}:".encode() + encoded)
        path = token_cache_dir() / f"{digest.hexdigest()}.safetensors"
    if path is not None and path.is_file():
        try:
            return load_file(path)["input_ids"].long()
        except (OSError, KeyError, SafetensorError):
            pass  # cut short or damaged: tokenize again and replace it
    ids = torch.tensor(pack_blocks(texts, tokenizer, seq_len)["input_ids"][:], dtype=torch.long)  # [N, seq_len]
    if path is not None:
        try:  # token ids fit in int32: half the file
            write_bytes_atomically(path, save({"input_ids": ids.to(torch.int32).contiguous()}))
        except OSError as error:  # a read-only or full disk costs the next run a tokenization, nothing more
            print(f"warning: could not cache the tokenized corpus in {path.parent} ({error})", file=sys.stderr)
    return ids


def document_position_ids(input_ids, eos_token_id: int):
    """Position ids of `[N, L]` packed blocks that restart at 0 after each `eos_token_id` and at each block start.

    The EOS token itself ends its document (it keeps that document's next position)."""
    import torch

    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = input_ids[..., :-1] == eos_token_id
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start


def training_blocks(options: DataOptions, tokenizer):
    """Blocks for training, drawn by the training loop in a seeded order.

    With `packing="plain"`, or a tokenizer without EOS, a `[N, seq_len]` LongTensor of token ids; with
    `packing="boundary"` a dict of that (`input_ids`) and its `position_ids` (`document_position_ids`). When
    streaming, an `IterableDataset` of such rows shuffled through a buffer with `options.seed`. A mix or
    teacher-generated source gives `generated.mixed_rows`' dict (with `labels` when it holds chat rows)."""
    import torch

    options.validate()
    from .generated import is_mixture, mixed_rows

    if is_mixture(options.dataset):  # several sources, weights, or teacher-generated chat: rows with labels
        return mixed_rows(options, tokenizer)
    texts = load_texts(options.dataset, options.dataset_split, options.text_column, options.streaming)
    eos = tokenizer.eos_token_id if options.packing == "boundary" else None
    if options.dataset.startswith("builtin:") and not options.streaming:
        ids = cached_blocks(texts, tokenizer, options.seq_len)
        if len(ids) == 0:
            raise ValueError(f"{options.dataset}: not enough text for one block of {options.seq_len} tokens")
        return ids if eos is None else {"input_ids": ids, "position_ids": document_position_ids(ids, eos)}
    blocks = pack_blocks(texts, tokenizer, options.seq_len)
    if options.streaming:
        if eos is not None:
            blocks = blocks.map(lambda row: {"position_ids": document_position_ids(
                torch.tensor(row["input_ids"]), eos).tolist()})
        return blocks.shuffle(seed=options.seed, buffer_size=options.shuffle_buffer)
    if len(blocks) == 0:
        raise ValueError(f"{options.dataset}: not enough text for one block of {options.seq_len} tokens")
    ids = torch.tensor(blocks["input_ids"][:], dtype=torch.long)
    return ids if eos is None else {"input_ids": ids, "position_ids": document_position_ids(ids, eos)}


def evaluation_texts(source: str, text_column: str = "text") -> list[list[str]]:
    """The texts of an evaluation source in groups scored with equal weight: one group per corpus of a built-in
    set (so that `builtin:crossdomain` weighs its corpora the same however many documents each has), a single
    group for any other source."""
    if not source.startswith("builtin:"):
        return [list(load_texts(source, text_column=text_column)["text"])]
    groups: dict[str, list[str]] = {}
    for doc in builtin_documents(source):
        groups.setdefault(doc.corpus, []).append(doc.text)
    return list(groups.values())


def evaluation_windows(source: str, tokenizer, seq_len: int, num_windows: int) -> "torch.Tensor":
    """`[num_windows, seq_len]` token windows of an evaluation source, split evenly over its groups
    (`evaluation_texts`) and within a group spread over its documents (`token_windows`)."""
    import torch

    from .windows import token_windows

    groups = evaluation_texts(source)
    counts = [num_windows // len(groups) + (i < num_windows % len(groups)) for i in range(len(groups))]
    return torch.cat([token_windows(tokenizer, texts, seq_len, n) for texts, n in zip(groups, counts) if n])
