"""Teacher-generated training data: distillation without a dataset.

`generate_data` has a teacher (a folder, Hub id or `.gguf` file; or a converted delta-attention student, which
writes its own answers) write
* answers to the built-in prompt set (`prompts.jsonl`: a few hundred everyday requests: lists, explanations,
  how-tos, stories, poems, rewriting, summaries, questions, advice, letters, small sums), each rendered with the
  teacher's chat template (`kind="chat"`), and
* text that continues built-in document openings (`kind="text"`).
Chat prompts holding `{passage}` are grounded prompts (a request about a text: repeat it, quote a sentence of it,
summarise it, ...): `grounded_share` of the chat samples answer one, with `{passage}` replaced by a passage of
training text (`--passages`, default `builtin:train`, never an evaluation split) chosen by the sample's seed, so the
student also sees chat turns that copy from and refer to their context (`grounded_passage`).
Generation is batched (left padding) and sampled (temperature, top-p). Every sample draws its tokens from its own
generator, seeded by (seed, kind, sample index), so its text does not depend on the batch size, on the other samples
of its batch, or on a resume. Samples are written as they are done, `shard_size` at a time, to
`OUT/chat/shard-NNNNN.parquet` and `OUT/text/shard-NNNNN.parquet` (each under a temporary name, then renamed); a
killed run continued with `--resume` skips the shards already written. `OUT/generation.json` records what
determines the text, and a resumed run must match it.

As a training source, `generated:OUT` gives the text rows packed like any text and the chat rows as padded rows whose
`labels` cover the answer tokens only (`chat.chat_rows`, the completion-only labels of `finetune`); `distill`'s stage
2 counts the KL on those tokens only. Sources mix by weight: `builtin:train@0.5+generated:OUT@0.5` (weights are
shares of the training rows; without weights the rows are simply put together).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from ..precision import native_bf16, warn_emulated_bf16
from .chat import _prompt, chat_rows, packed_chat_rows
from .text import _check_jsonl

#: the built-in prompt set: one `{"kind": "chat"|"text", "category": ..., "prompt": ...}` object a line
PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
KINDS = ("auto", "chat", "text", "both")
GENERATED_PREFIX = "generated:"
#: written in the output folder: the settings that determine the text, and the progress
RECORD = "generation.json"
#: what must be the same to resume a folder (the sample count may grow)
_FIXED_ON_RESUME = ("teacher", "kinds", "seed", "max_new_tokens", "temperature", "top_p", "shard_size",
                    "prompts_sha256", "grounded_share", "passages", "dtype")
#: the teacher's weight types while it writes (`--dtype`); a folder recorded before the option was float32
DTYPES = ("float32", "bfloat16")
#: the placeholder of a grounded prompt, replaced by a passage of training text
PASSAGE = "{passage}"
#: words per passage of a grounded prompt (from a sentence start; cut at a sentence end where one is near)
PASSAGE_WORDS = (60, 180)


@dataclasses.dataclass
class GenerateOptions:
    """Which teacher writes what, and where."""

    teacher: str = dataclasses.field(
        default=None, metadata={
            "help": "the model that writes: the teacher (model folder, Hub id or .gguf file), or a converted "
                    "delta-attention model writing its own answers", "positional": True}
    )
    output_dir: str = dataclasses.field(default="generated", metadata={"help": "folder of the parquet shards"})
    kind: str = dataclasses.field(
        default="auto", metadata={"help": "chat (answers to the prompt set), text (continued openings), both, or "
                                          "auto (chat when the teacher's tokenizer has a chat template, else text)"}
    )
    num_samples: int = dataclasses.field(default=256, metadata={"help": "samples of each kind"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed of the prompt order and of every sample's draws"})
    max_new_tokens: int = dataclasses.field(default=256, metadata={"help": "longest answer or continuation, in tokens"})
    temperature: float = dataclasses.field(default=0.7, metadata={"help": "sampling temperature (0 = greedy)"})
    top_p: float = dataclasses.field(default=0.9, metadata={"help": "nucleus sampling: keep the top tokens of this mass"})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "prompts generated together"})
    dtype: str = dataclasses.field(
        default="float32", metadata={"help": "the teacher's weights while it writes: float32, or bfloat16 (faster on "
                                             "a CPU with AMX or AVX512-BF16; its samples may then change with "
                                             "--batch_size, which float32's hardly ever do)"})
    grounded_share: float = dataclasses.field(
        default=0.25, metadata={"help": "share of the chat samples that answer a grounded prompt (one holding "
                                        "{passage}: a request about a passage of --passages text); 0 = none"})
    passages: str = dataclasses.field(
        default="builtin:train", metadata={"help": "the text grounded prompts quote: builtin:train or a local "
                                                   ".txt/.jsonl/.parquet file or folder (never an evaluation split)"})
    shard_size: int = dataclasses.field(default=64, metadata={"help": "samples per parquet shard (the resume unit)"})
    prompts: str | None = dataclasses.field(
        default=None, metadata={"help": 'a .jsonl file of {"prompt": ..., "kind": "chat"|"text"} lines '
                                        "(default: the built-in set)"}
    )
    resume: bool = dataclasses.field(default=False, metadata={"help": "continue an interrupted run in output_dir"})
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "replace an existing output_dir (written by this tool) once the run is done"}
    )
    force_overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "with --overwrite: replace output_dir even if this tool did not write it"}
    )

    def validate(self) -> GenerateOptions:
        """Raise a `ValueError` naming the flag when an option cannot work (before the teacher is loaded)."""
        if not self.teacher:
            raise ValueError("give the teacher: delta-attention generate-data TEACHER --output_dir OUT")
        if self.kind not in KINDS:
            raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("num_samples", "max_new_tokens", "batch_size", "shard_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a whole number >= 1, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"--top_p must be in (0, 1] (1 = no nucleus cut), got {self.top_p!r}")
        if not (isinstance(self.grounded_share, (int, float)) and 0 <= self.grounded_share <= 1):
            raise ValueError(f"--grounded_share must be in [0, 1] (0 = no grounded prompts), "
                             f"got {self.grounded_share!r}")
        from .text import check_trainable

        check_trainable(self.passages)  # the held-out and cross-domain text never reaches a prompt either
        return self


# ---------------------------------------------------------------------------------------------------- prompts


def load_prompts(path: str | os.PathLike | None = None) -> list[dict]:
    """The prompt set: dicts with `kind` ("chat" or "text"), `category` and `prompt` (default: the built-in set)."""
    path = Path(path).expanduser() if path else PROMPTS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file; give a .jsonl file of "
                                '{"prompt": "..."} lines, or leave --prompts out for the built-in set')
    _check_jsonl(path)
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        prompt, kind = entry.get("prompt"), entry.get("kind", "chat")
        if not isinstance(prompt, str) or not prompt.strip() or kind not in ("chat", "text"):
            raise ValueError(f"{path}: line {number} needs a non-empty string 'prompt' and a 'kind' of chat or text "
                             f"(default chat), got {line[:80]!r}")
        prompts.append({"kind": kind, "category": str(entry.get("category", "")), "prompt": prompt})
    return prompts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def sample_seed(seed: int, kind: str, index: int) -> int:
    """The seed of sample `index` of `kind`: a function of these three only (not of batches or resumes)."""
    digest = hashlib.sha256(f"{seed}:{kind}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def prompt_order(num_prompts: int, seed: int, count: int) -> list[int]:
    """Which prompt each of the first `count` samples answers: seeded permutations of the set, one after another
    (so a few samples already cover many categories, and a prompt repeats only once all have been used)."""
    from ..training.loop import data_order

    order = data_order(num_prompts, seed, 0)
    return [next(order) for _ in range(count)]


def is_grounded(entry: dict) -> bool:
    """Whether a prompt-set entry is a grounded chat prompt (its text holds `{passage}`)."""
    return entry["kind"] == "chat" and PASSAGE in entry["prompt"]


def grounded_samples(count: int, share: float) -> list[bool]:
    """Which of the first `count` chat samples answer a grounded prompt: `share` of them, evenly spaced (sample i
    when floor((i + 1) * share) > floor(i * share)), so any prefix of the samples, and so a resumed or enlarged run,
    keeps the share."""
    return [math.floor((i + 1) * share) > math.floor(i * share) for i in range(count)]


def chat_prompt_order(entries: list[tuple[int, dict]], seed: int, count: int, share: float) -> list[int]:
    """Which entry of `entries` (the chat prompts) each of the first `count` chat samples answers: the grounded
    samples (`grounded_samples`) go through the grounded prompts in seeded permutations, the others through the
    rest (`prompt_order` each). Without grounded prompts every sample takes a plain one, and the other way round."""
    grounded = [i for i, (_, entry) in enumerate(entries) if is_grounded(entry)]
    plain = [i for i, (_, entry) in enumerate(entries) if not is_grounded(entry)]
    flags = grounded_samples(count, share if grounded and plain else float(bool(grounded)))
    orders = {True: iter(prompt_order(len(grounded), seed, sum(flags))),
              False: iter(prompt_order(len(plain), seed, count - sum(flags)))}
    pools = {True: grounded, False: plain}
    return [pools[flag][next(orders[flag])] for flag in flags]


def passage_documents(source: str, named: str | None = None,
                      fix: str = "give longer texts or --grounded_share 0") -> list[str]:
    """The texts of `source` (`builtin:train` or a local text source) long enough to draw a passage from
    (`passage_span`); none is a `ValueError` naming the source as `named` (default `--passages SOURCE`) and the
    `fix`."""
    from .text import load_texts

    texts = [text for text in load_texts(source)["text"] if len(text.split()) >= PASSAGE_WORDS[0]]
    if not texts:
        raise ValueError(f"{named or f'--passages {source}'}: no text of at least {PASSAGE_WORDS[0]} words to "
                         f"quote; {fix}")
    return texts


def passage_span(texts: list[str], sample_seed_value: int) -> tuple[int, int, int]:
    """Where the passage of a sample lies, drawn by the sample's seed alone: (index of the text, first word, end
    word), words as `str.split` gives them. A text, then a start just after a sentence end (or the text's start),
    then a length of 60-180 words, the end moved back to the last sentence end in its second half."""
    import random

    draw = random.Random(sample_seed_value)
    document = draw.randrange(len(texts))
    words = texts[document].split()
    length = draw.randint(*PASSAGE_WORDS)
    start = draw.randrange(max(1, len(words) - length))
    sentence_start = next((i + 1 for i in range(start, min(start + length // 2, len(words) - 1))
                           if words[i].endswith((".", "!", "?"))), start)
    if len(words) - sentence_start >= PASSAGE_WORDS[0]:
        start = sentence_start
    end = min(start + length, len(words))
    sentence_end = next((i + 1 for i in range(end - 1, start + (end - start) // 2, -1)
                         if words[i].endswith((".", "!", "?"))), end)
    return document, start, sentence_end


def grounded_passage(texts: list[str], sample_seed_value: int) -> str:
    """The passage of one of `texts` that a grounded prompt quotes (`passage_span`), whitespace collapsed to single
    spaces."""
    document, start, end = passage_span(texts, sample_seed_value)
    return " ".join(texts[document].split()[start:end])


def fill_prompt(entry: dict, passages: list[str] | None, sample_seed_value: int) -> dict:
    """The entry a sample answers: a grounded prompt with its `{passage}` filled in (`grounded_passage`), any other
    as it is."""
    if not is_grounded(entry):
        return entry
    return {**entry, "prompt": entry["prompt"].replace(PASSAGE, grounded_passage(passages, sample_seed_value))}


def prompt_ids(tokenizer, kind: str, prompt: str) -> list[int]:
    """Token ids the teacher continues: the user turn and the assistant header through the chat template (chat), or
    the opening as plain text with the tokenizer's special tokens (text)."""
    if kind == "chat":
        return _prompt(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


# ---------------------------------------------------------------------------------------------------- sampling


class SeededSampling(LogitsProcessor):
    """A logits processor that draws each row's next token with that row's own `torch.Generator` (after temperature
    and top-p), and returns scores that are `-inf` except at the drawn token, for greedy decoding to take.

    One draw per row and step from the row's generator: the tokens of a row depend on its logits and its seed only.
    """

    def __init__(self, generators: list[torch.Generator], temperature: float, top_p: float):
        self.generators = generators
        self.greedy = temperature == 0
        warpers = [] if self.greedy else [TemperatureLogitsWarper(temperature)]
        if top_p < 1 and not self.greedy:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # scores: [B, V]
        scores = scores.float()
        if self.greedy:
            tokens = scores.argmax(dim=-1, keepdim=True)  # [B, 1]
        else:
            probs = self.warpers(input_ids, scores).softmax(dim=-1)
            tokens = torch.stack([torch.multinomial(row, 1, generator=generator)
                                  for row, generator in zip(probs, self.generators)])  # [B, 1]
        chosen = torch.full_like(scores, -math.inf)
        return chosen.scatter_(1, tokens, 0.0)


def _stop_ids(model, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = ids if ids is not None else tokenizer.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def generate_batch(model, tokenizer, prompts: list[list[int]], seeds: list[int], max_new_tokens: int,
                   temperature: float, top_p: float) -> list[tuple[list[int], bool]]:
    """Continue each prompt (token ids) with sampling seeded per prompt; returns `(new_ids, finished)` per prompt,
    `new_ids` without the end-of-sequence token, `finished` whether the teacher ended it before `max_new_tokens`."""
    stop = _stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    width = max(len(ids) for ids in prompts)
    # left padding: every prompt ends at the last column, where generation starts
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])  # [B, width]
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])  # [B, width]
    sampler = SeededSampling([torch.Generator().manual_seed(s) for s in seeds], temperature, top_p)
    with torch.no_grad():
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                do_sample=False, temperature=None, top_p=None, top_k=None,
                                logits_processor=LogitsProcessorList([sampler]), pad_token_id=pad, eos_token_id=stop)
    results = []
    for row in output[:, width:].tolist():  # [B, new]
        end = next((i for i, token in enumerate(row) if token in stop), None)
        results.append((row if end is None else row[:end], end is not None))
    return results


# ---------------------------------------------------------------------------------------------------- writing


def _shard_path(out: Path, kind: str, shard: int) -> Path:
    return out / kind / f"shard-{shard:05d}.parquet"


def _shard_rows(path: Path) -> int:
    """Rows in a written shard; -1 when there is none (or it is unreadable: it is written again)."""
    import pyarrow
    import pyarrow.parquet

    if not path.is_file():
        return -1
    try:
        return pyarrow.parquet.read_metadata(path).num_rows
    except (pyarrow.ArrowException, OSError):
        return -1


def _write_shard(path: Path, rows: list[dict]) -> None:
    """Write `rows` as one parquet file, under a temporary name renamed when complete."""
    import pyarrow
    import pyarrow.parquet

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), partial)
    os.replace(partial, path)


def _sample_row(tokenizer, kind: str, index: int, entry: dict, prompt_index: int, ids: list[int],
                new_ids: list[int], finished: bool) -> dict:
    row = {"index": index, "prompt_index": prompt_index, "category": entry["category"], "prompt": entry["prompt"]}
    if kind == "chat":
        answer = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
        row["messages"] = [{"role": "user", "content": entry["prompt"]}, {"role": "assistant", "content": answer}]
    else:
        row["text"] = tokenizer.decode(ids + new_ids, skip_special_tokens=True)
    return {**row, "finished": finished, "new_tokens": len(new_ids)}


def _resolve_kinds(kind: str, tokenizer, teacher: str) -> list[str]:
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if kind == "auto":
        return ["chat"] if has_template else ["text"]
    kinds = ["chat", "text"] if kind == "both" else [kind]
    if "chat" in kinds and not has_template:
        raise ValueError(f"the teacher {teacher} has no chat template, so it cannot answer chat prompts; "
                         "use --kind text")
    return kinds


def _teacher_name(spec: str) -> str:
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def _open_record(out: Path, settings: dict, num_samples: int) -> dict:
    """The folder's `generation.json`: created, or checked against `settings` when the folder is continued."""
    from ..output_folder import RUN_MARKER

    path = out / RECORD
    if path.is_file():
        record = json.loads(path.read_text())
        record.setdefault("dtype", "float32")  # written before --dtype existed
        changed = [f"{key} was {record.get(key)!r}, now {settings.get(key)!r}" for key in _FIXED_ON_RESUME
                   if record.get(key) != settings.get(key)]
        if changed:
            raise ValueError(f"cannot resume {out}: {'; '.join(changed)}; resume with the same options, or write to a "
                             "new --output_dir")
        if num_samples < record["num_samples"]:
            raise ValueError(f"cannot resume {out} with --num_samples {num_samples}: it was started for "
                             f"{record['num_samples']} samples of each kind (more are fine, fewer are not)")
    elif any(p.name not in (RUN_MARKER,) and not p.name.startswith(".") for p in out.iterdir()):
        raise ValueError(f"cannot resume {out}: it holds no {RECORD}, so generate-data did not write it; "
                         "write to a new --output_dir")
    else:
        record = dict(settings)
    record.update(num_samples=num_samples, complete=False)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def generate_data(options: GenerateOptions) -> dict:
    """Have the teacher write the samples (skipping shards already written); returns a summary, also recorded in
    `output_dir/generation.json`."""
    from tqdm.auto import tqdm

    from ..loading import check_model_spec, load_model
    from ..output_folder import check_output_folder, open_run_folder

    options.validate()
    check_model_spec(options.teacher, "teacher")
    prompts = load_prompts(options.prompts)
    check_output_folder(options.output_dir, overwrite=options.overwrite, resume=options.resume,
                        force=options.force_overwrite, inputs=(options.teacher, options.prompts))
    if options.dtype == "bfloat16" and not native_bf16("cpu"):
        warn_emulated_bf16("--dtype bfloat16", "--dtype float32 is faster here")
    # any causal LM writes: a source model, or a delta-attention student (its own answers, scored by the teacher's KL
    # when stage 2 trains on them)
    model, tokenizer = load_model(options.teacher, dtype=getattr(torch, options.dtype), what="teacher")
    kinds = _resolve_kinds(options.kind, tokenizer, options.teacher)
    by_kind = {kind: [(i, p) for i, p in enumerate(prompts) if p["kind"] == kind] for kind in kinds}
    for kind, entries in by_kind.items():
        if not entries:
            raise ValueError(f"{options.prompts or PROMPTS_FILE} holds no {kind} prompts; add some or choose "
                             f"another --kind")
    grounded = "chat" in kinds and options.grounded_share > 0 and any(is_grounded(p) for _, p in by_kind["chat"])
    if "chat" in kinds and options.grounded_share == 0:  # grounded prompts are not answered at all
        by_kind["chat"] = [(i, p) for i, p in by_kind["chat"] if not is_grounded(p)]
        if not by_kind["chat"]:
            raise ValueError(f"{options.prompts or PROMPTS_FILE} holds only grounded chat prompts (with {PASSAGE}); "
                             "give --grounded_share above 0")
    passages = passage_documents(options.passages) if grounded else None

    run = open_run_folder(Path(options.output_dir), "generate-data", overwrite=options.overwrite,
                          resume=options.resume)
    out = run.work
    settings = {"teacher": _teacher_name(options.teacher), "kinds": kinds, "seed": options.seed,
                "max_new_tokens": options.max_new_tokens, "temperature": float(options.temperature),
                "top_p": float(options.top_p), "shard_size": options.shard_size,
                "prompts": "built-in" if not options.prompts else Path(options.prompts).name,
                "prompts_sha256": _sha256(Path(options.prompts).expanduser() if options.prompts else PROMPTS_FILE),
                "grounded_share": float(options.grounded_share) if grounded else None,
                "passages": options.passages if grounded else None, "dtype": options.dtype}
    record = _open_record(out, settings, options.num_samples)

    size, count = options.shard_size, options.num_samples
    shards = {kind: [s for s in range(math.ceil(count / size))
                     if _shard_rows(_shard_path(out, kind, s)) != min(size, count - s * size)] for kind in kinds}
    done = sum(count - sum(min(size, count - s * size) for s in todo) for todo in shards.values())
    bar = tqdm(total=count * len(kinds), initial=done, unit="sample", desc="generating", dynamic_ncols=True)
    new_samples, new_tokens, started = 0, 0, time.perf_counter()
    for kind in kinds:
        entries = by_kind[kind]
        order = (chat_prompt_order(entries, options.seed, count, options.grounded_share) if kind == "chat"
                 else prompt_order(len(entries), options.seed, count))
        for shard in shards[kind]:
            indices = range(shard * size, min((shard + 1) * size, count))
            rows = []
            for first in range(0, len(indices), options.batch_size):
                batch = indices[first : first + options.batch_size]
                seeds = [sample_seed(options.seed, kind, i) for i in batch]  # a sample's passage and its draws
                chosen = [(entries[order[i]][0], fill_prompt(entries[order[i]][1], passages, seed))
                          for i, seed in zip(batch, seeds)]
                ids = [prompt_ids(tokenizer, kind, entry["prompt"]) for _, entry in chosen]
                outputs = generate_batch(model, tokenizer, ids, seeds, options.max_new_tokens, options.temperature,
                                         options.top_p)
                for i, (prompt_index, entry), prompt, (new_ids, finished) in zip(batch, chosen, ids, outputs):
                    rows.append(_sample_row(tokenizer, kind, i, entry, prompt_index, prompt, new_ids, finished))
                    new_tokens += len(new_ids)
                new_samples += len(batch)
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):,.1f}")
            _write_shard(_shard_path(out, kind, shard), rows)
    bar.close()
    seconds = time.perf_counter() - started
    record.update(complete=True, last_run={"samples": new_samples, "new_tokens": new_tokens, "seconds": seconds,
                                           "samples_per_s": new_samples / max(seconds, 1e-9),
                                           "tokens_per_s": new_tokens / max(seconds, 1e-9)})
    (out / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    run.finish()
    return record


# ---------------------------------------------------------------------------------------------------- reading


def generated_folder(source: str) -> Path:
    """The folder of a `generated:OUT` source; an error when generate-data did not write it."""
    folder = Path(source[len(GENERATED_PREFIX):]).expanduser()
    if not (folder / RECORD).is_file():
        raise FileNotFoundError(f"{source}: {folder} is not a generate-data folder (no {RECORD}); write one with "
                                f"`delta-attention generate-data TEACHER --output_dir {folder}`")
    return folder


def generated_kinds(folder: Path, source: str) -> list[str]:
    """The kinds of samples ("text", "chat") a generate-data folder holds shards of; a warning when the generation
    did not finish."""
    if not json.loads((folder / RECORD).read_text()).get("complete"):
        print(f"warning: {source}: the generation did not finish; training on the shards written so far "
              "(continue it with generate-data --resume)")
    return [kind for kind in ("text", "chat") if any((folder / kind).glob("shard-*.parquet"))]


def generated_subfolder(source: str, column: str) -> str:
    """The folder of a `generated:OUT` source that holds `column`: `OUT/chat` for `messages`, `OUT/text` otherwise."""
    folder = generated_folder(source)
    kind = "chat" if column == "messages" else "text"
    if kind not in generated_kinds(folder, source):
        raise ValueError(f"{source}: no {kind} samples in {folder} (generate-data --kind {kind} or both writes them)")
    return str(folder / kind)


def parse_sources(spec: str) -> list[tuple[str, float | None]]:
    """`A@w+B@v` as `[(A, w), (B, v)]` (weight None where none is given); an existing path is one source."""
    if Path(spec).expanduser().exists():
        return [(spec, None)]
    parts = []
    for part in spec.split("+"):
        part = part.strip()
        name, at, weight = part.rpartition("@")
        if not part or (at and not name):
            raise ValueError(f"--dataset {spec!r}: an empty source in the mix; write sources as A+B or A@0.7+B@0.3")
        if not at or Path(part).expanduser().exists():
            parts.append((part, None))
            continue
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not value > 0 or math.isinf(value):
            raise ValueError(f"--dataset {spec!r}: the weight of {name!r} must be a positive number after @, got "
                             f"{weight!r}")
        parts.append((name, value))
    if len({weight is None for _, weight in parts}) > 1:
        raise ValueError(f"--dataset {spec!r}: give a weight to every source of the mix or to none")
    return parts


def check_sources(spec: str) -> None:
    """The checks of a `--dataset` that read no data: every source of a mix (the text of a `quote:` source) may be
    trained on (`text.check_trainable`), every `generated:` folder was written by generate-data."""
    from .quotes import QUOTE_PREFIX, quote_source
    from .text import check_trainable

    for source, _ in parse_sources(spec):
        check_trainable(quote_source(source) if source.startswith(QUOTE_PREFIX) else source)
        if source.startswith(GENERATED_PREFIX):
            generated_folder(source)


def is_mixture(spec: str) -> bool:
    """Whether `spec` needs `mixed_rows`: several sources, a weight, teacher-generated data or quote data."""
    from .quotes import QUOTE_PREFIX

    parts = parse_sources(spec) if str(spec).strip() else []
    return len(parts) > 1 or any(w is not None or name.startswith((GENERATED_PREFIX, QUOTE_PREFIX))
                                 for name, w in parts)


def _text_rows(options, tokenizer) -> dict:
    from .text import training_blocks

    blocks = training_blocks(options, tokenizer)
    return blocks if isinstance(blocks, dict) else {"input_ids": blocks}


def _chat_rows(conversations, options, tokenizer) -> dict:
    """Rows of chat `conversations` with completion-only `labels`: with boundary packing, as many conversations to
    a row as fit, each with position ids from 0 (`chat.packed_chat_rows`, which stack with packed text rows); with
    plain packing, one right-padded conversation a row."""
    if options.packing == "boundary":
        return packed_chat_rows(tokenizer, conversations, options.seq_len, completion_only=True)
    rows = chat_rows(tokenizer, conversations, options.seq_len, completion_only=True)
    rows.pop("attention_mask")  # right padding: causal models never look at it, and the labels leave it out
    return rows


def _source_rows(source: str, options, tokenizer) -> list[dict]:
    """The row sets of one source: packed text blocks and/or chat rows with completion-only labels."""
    from .quotes import QUOTE_PREFIX, quote_conversations
    from .text import load_texts

    if source.startswith(QUOTE_PREFIX):
        return [_chat_rows(quote_conversations(source, options.seed), options, tokenizer)]
    if not source.startswith(GENERATED_PREFIX):
        return [_text_rows(dataclasses.replace(options, dataset=source), tokenizer)]
    folder = generated_folder(source)
    kinds = generated_kinds(folder, source)
    if not kinds:
        raise ValueError(f"{source}: {folder} holds no samples yet; run generate-data --resume to write them")
    rows = []
    if "text" in kinds:
        text = dataclasses.replace(options, dataset=str(folder / "text"), text_column="text", dataset_split="train")
        rows.append(_text_rows(text, tokenizer))
    if "chat" in kinds:
        table = load_texts(str(folder / "chat"), text_column="messages", column_flag="--messages_column")
        rows.append(_chat_rows(table["text"], options, tokenizer))
    return rows


def _concatenate(row_sets: list[dict]) -> dict:
    """One dict of `[N, L]` tensors from several; when any set has `labels`, sets without get their token ids."""
    keys = set().union(*row_sets)
    if any(key not in rows for rows in row_sets for key in keys - {"labels"}):
        raise ValueError("the sources of the mix were cut differently (position ids in some only); "
                         "use one --packing for all")
    return {key: torch.cat([rows.get(key, rows["input_ids"]) for rows in row_sets]) for key in sorted(keys)}


def mixed_rows(options, tokenizer):
    """Training rows of a mixed or teacher-generated `--dataset` (see `parse_sources`): a dict of `[N, seq_len]`
    tensors, `input_ids` and, as the sources need, `position_ids` and `labels` (-100 outside chat answers).

    With weights, each source contributes its share of the rows: the mix has `max_i ceil(n_i / share_i)` rows (no
    source loses any), a source's rows repeating, in a seeded order, as often as its share needs."""
    from ..training.loop import data_order

    if options.streaming:
        raise ValueError("--streaming does not apply to teacher-generated data or mixes of sources (they are read "
                         "into memory); drop --streaming")
    sources = parse_sources(options.dataset)
    per_source = [_concatenate(_source_rows(name, options, tokenizer)) for name, _ in sources]
    weights = [weight for _, weight in sources]
    if weights[0] is None:
        return per_source[0] if len(per_source) == 1 else _concatenate(per_source)
    sizes = [len(rows["input_ids"]) for rows in per_source]
    shares = [weight / sum(weights) for weight in weights]
    total = max(math.ceil(size / share) for size, share in zip(sizes, shares))
    picked = []
    for number, (rows, size, share) in enumerate(zip(per_source, sizes, shares)):
        order = data_order(size, options.seed + number, 0)
        index = torch.tensor([next(order) for _ in range(max(1, round(share * total)))])
        picked.append({key: value[index] for key, value in rows.items()})
    return _concatenate(picked)


__all__ = [
    "GENERATED_PREFIX",
    "GenerateOptions",
    "PROMPTS_FILE",
    "SeededSampling",
    "chat_prompt_order",
    "check_sources",
    "fill_prompt",
    "generate_batch",
    "generate_data",
    "generated_folder",
    "generated_kinds",
    "generated_subfolder",
    "grounded_passage",
    "grounded_samples",
    "is_grounded",
    "is_mixture",
    "load_prompts",
    "mixed_rows",
    "parse_sources",
    "passage_span",
    "prompt_ids",
    "prompt_order",
    "sample_seed",
]
