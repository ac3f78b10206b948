"""Speculative and prompt-lookup decoding, and answers from a saved state, on converted SmolLM2 models.

    delta-attention bench-speculative [--hybrid_model DIR] [--delta_model DIR]    (or: benchmark --parts speculative)

For the hybrid and the all-delta conversion of the offline SmolLM2-135M-Instruct GGUF (the layouts of the
distillation benchmark, `bench_distill.LAYOUTS`: 8 of 30 layers softmax, and every layer but layer 0 delta;
converted here, calibrated init, unless model folders are given), greedy decoding against prompt-lookup decoding
and against an assistant model, on (a) an input-grounded task, quoting a held-out passage back ("Repeat the
passage above word for word."), and (b) free continuation of held-out passages: tokens/s, the share of drafted
tokens the model accepted, tokens per verification step, and whether every output is token for token the greedy
one. Then the time to the first token of an answer about a long document (32k tokens by default) continued from
its saved state (`load_cache`, the file read included) against re-reading the document. Writes
`speculative.json`, `speculative.md` and `speculative.png` under `--output_dir`.

The assistant: unless `--assistant_model` names a model (same tokenizer), each target drafts with its own first
`--draft_layers` layers, an early exit that shares the target's embeddings, layers, final norm and LM head (no
extra weights, a third of the target's cost per drafted token at 10 of 30 layers). A separately trained small
draft does not exist for these models; the other conversion is as deep as the target, so it could not be faster.

`--layouts ...,teacher` also measures the source model itself (the offline GGUF, or `--teacher_model`), greedy
against prompt lookup through transformers' own decoding: the speed-up the model being replaced gets from the
same drafts, the peer the converted models' ratios compare with (no assistant or saved state for it).

Drafted and accepted tokens are counted by wrapping the candidate generator `generate` builds (on the target
instance, for the duration of one call). All methods run one after the other on each prompt (side by side), so
their ratios are comparable; run it on an idle machine.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from delta_attention.conversion.memory import human_bytes
from delta_attention.modeling import DeltaConfig, DeltaForCausalLM, load_cache, save_cache

METHODS = ("greedy", "prompt lookup", "assistant")
#: consecutive tokens found in the prompt that count an answer's tokens as copied (`copied_share`)
COPY_RUN = 8
TASKS = ("grounded", "continuation", "document")
QUOTE_REQUEST = "Repeat the passage above word for word."
QUESTION = "\n\nQuestion: What is the text above about? Answer in one sentence.\nAnswer:"


@dataclasses.dataclass
class SpeculativeOptions:
    output_dir: str = dataclasses.field(default="results/speculative", metadata={"help": "results folder"})
    layouts: str = dataclasses.field(
        default="hybrid,all-delta", metadata={"help": "hybrid, all-delta and/or teacher (the source model: greedy and "
                                                      "prompt lookup only); hybrid+packed and all-delta+packed: the "
                                                      "same model with packed weights (pack_linear_weights)"})
    hybrid_model: str | None = dataclasses.field(
        default=None, metadata={"help": "a converted hybrid model folder (default: convert the offline GGUF into "
                                        "OUTPUT_DIR/models/hybrid, or reuse what an earlier run put there)"})
    delta_model: str | None = dataclasses.field(
        default=None, metadata={"help": "a converted all-delta model folder (default: as --hybrid_model)"})
    teacher_model: str | None = dataclasses.field(
        default=None, metadata={"help": "the source model for --layouts teacher (default: the offline SmolLM2 GGUF)"})
    assistant_model: str | None = dataclasses.field(
        default=None, metadata={"help": "draft model folder with the same tokenizer (default: each target's first "
                                        "--draft_layers layers)"})
    draft_layers: int = dataclasses.field(default=10, metadata={"help": "layers of the early-exit draft"})
    draft_tokens: int = dataclasses.field(default=8, metadata={"help": "tokens the assistant drafts per step"})
    lookup_tokens: int = dataclasses.field(default=10, metadata={"help": "prompt lookup: tokens drafted per step"})
    lookup_ngram: int = dataclasses.field(default=2, metadata={"help": "prompt lookup: longest n-gram matched"})
    tasks: str = dataclasses.field(default="grounded,continuation,document", metadata={"help": f"subset of {TASKS}"})
    passages: int = dataclasses.field(default=4, metadata={"help": "held-out passages per task"})
    passage_tokens: int = dataclasses.field(default=256, metadata={"help": "tokens per passage"})
    new_tokens: int = dataclasses.field(default=128, metadata={"help": "most tokens generated per prompt"})
    document_tokens: int = dataclasses.field(
        default=32768, metadata={"help": "the long document (a multiple of the model's prefill piece, 4096, or less)"})
    answer_tokens: int = dataclasses.field(default=16, metadata={"help": "tokens of the answer about the document"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "float32 | bfloat16"})
    threads: int = dataclasses.field(default=0, metadata={"help": "torch threads (0: torch's default)"})

    def validate(self) -> list[str]:
        """The tasks asked for; a one-line `ValueError` for any bad option."""
        tasks = [t.strip() for t in self.tasks.split(",") if t.strip()]
        if not tasks or set(tasks) - set(TASKS):
            raise ValueError(f"--tasks must be a comma-separated subset of {list(TASKS)}, got {self.tasks!r}")
        for name in ("draft_layers", "draft_tokens", "lookup_tokens", "lookup_ngram", "passages", "passage_tokens",
                     "new_tokens", "document_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        piece = DeltaForCausalLM.prefill_piece_size
        if self.document_tokens > piece and self.document_tokens % piece:
            raise ValueError(f"--document_tokens ({self.document_tokens}) must be a multiple of {piece} (the prefill "
                             "piece) or at most it, so that re-reading and the saved state split the document alike")
        return tasks


# ----------------------------------------------------------------------------------------------- prompts


def _ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def heldout_passages(tokenizer, texts: list[str], count: int, tokens: int) -> list[str]:
    """`count` passages of about `tokens` tokens, evenly spaced through the held-out texts (joined), as text."""
    ids = _ids(tokenizer, "\n\n".join(texts))[0]
    stride = (ids.numel() - tokens) // max(count, 1)
    if stride < 0:
        raise ValueError(f"the held-out texts hold {ids.numel()} tokens, fewer than one passage of {tokens}")
    return [tokenizer.decode(ids[i * stride : i * stride + tokens]) for i in range(count)]


def quote_prompt(tokenizer, passage: str) -> torch.Tensor:
    """[1, T]: the passage and the request to repeat it, in the chat template when the tokenizer has one."""
    request = f"{passage}\n\n{QUOTE_REQUEST}"
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                                return_dict=True, return_tensors="pt")
        return encoded["input_ids"]
    return _ids(tokenizer, request + "\n\n")


def document_and_question(tokenizer, texts: list[str], tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, tokens] the first `tokens` tokens of the held-out texts, [1, Q] the question asked after them)."""
    document = _ids(tokenizer, "\n\n".join(texts))[:, :tokens]
    if document.shape[1] < tokens:
        raise ValueError(f"the held-out texts hold {document.shape[1]} tokens, fewer than --document_tokens {tokens}")
    return document, _ids(tokenizer, QUESTION)


# ----------------------------------------------------------------------------------------------- drafts


def early_exit_draft(model, layers: int):
    """`model`'s first `layers` layers with its final norm and LM head, as a model of its own: the modules are the
    target's (shared, nothing copied), the config says `layers` layers, so its cache has that many."""
    if layers >= model.config.num_hidden_layers:
        raise ValueError(f"--draft_layers ({layers}) must be fewer than the target's {model.config.num_hidden_layers} "
                         "layers")
    config = DeltaConfig.from_dict({**model.config.to_dict(), "num_hidden_layers": layers,
                                    "layer_types": list(model.config.layer_types[:layers])})
    with torch.device("meta"):
        draft = DeltaForCausalLM(config)
    draft.model.embed_tokens, draft.model.norm = model.model.embed_tokens, model.model.norm
    draft.model.layers = torch.nn.ModuleList(list(model.model.layers[:layers]))
    draft.model.rotary_emb, draft.lm_head = model.model.rotary_emb, model.lm_head
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft.eval()


class DraftCounter:
    """Wraps the candidate generator of one assisted or prompt-lookup `generate` call and counts its verification
    steps, the tokens it drafted and the tokens the model accepted."""

    def __init__(self, generator):
        self.generator = generator
        self.steps = self.drafted = self.accepted = 0

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def get_candidates(self, input_ids, **kwargs):
        candidates, logits = self.generator.get_candidates(input_ids, **kwargs)
        self.steps += 1
        self.drafted += candidates.shape[1] - input_ids.shape[1]
        return candidates, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.accepted += int(num_matches)
        return self.generator.update_candidate_strategy(input_ids, scores, num_matches)


@contextlib.contextmanager
def counted_drafts(model):
    """Within the block, the candidate generators `model.generate` builds are `DraftCounter`s (listed in the list
    yielded). Only this instance is touched, and only until the block ends."""
    counters = []
    build = model._get_candidate_generator

    def counted(*args, **kwargs):
        counters.append(DraftCounter(build(*args, **kwargs)))
        return counters[-1]

    model._get_candidate_generator = counted
    try:
        yield counters
    finally:
        del model._get_candidate_generator


# ----------------------------------------------------------------------------------------------- measuring


def generate_timed(model, input_ids: torch.Tensor, method: str, options: SpeculativeOptions, draft=None,
                   new_tokens: int | None = None) -> dict:
    """One greedy `generate` by `method`: the new tokens, the seconds, the seconds to the first step's tokens and
    their count (the prefill, and for drafting methods the first verification), and the draft counts (none for
    greedy)."""
    kwargs = dict(max_new_tokens=new_tokens or options.new_tokens, do_sample=False)
    if model.generation_config.pad_token_id is None:
        eos = model.generation_config.eos_token_id
        kwargs["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    if method == "prompt lookup":
        kwargs.update(prompt_lookup_num_tokens=options.lookup_tokens, max_matching_ngram_size=options.lookup_ngram)
    elif method == "assistant":
        draft.generation_config.num_assistant_tokens = options.draft_tokens
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = draft
    timer = FirstTokenTimer()
    with counted_drafts(model) as counters, torch.no_grad():
        started = time.perf_counter()
        output = model.generate(input_ids, streamer=timer, **kwargs)
        seconds = time.perf_counter() - started
    counts = {key: sum(getattr(c, key) for c in counters) for key in ("steps", "drafted", "accepted")}
    return {"tokens": output[0, input_ids.shape[1] :], "seconds": seconds,
            "first_token_seconds": timer.first - started, "first_tokens": timer.first_tokens,
            **(counts if counters else {})}


def copied_share(output: list[int], prompt: list[int], run: int = COPY_RUN) -> float:
    """Share of the `output` tokens that lie in a run of at least `run` consecutive tokens also found in `prompt`:
    how much of an answer quotes its input. Prompt lookup accepts drafts copied from the prompt or from the answer's
    own earlier tokens, so a looping answer is accepted too; this tells the two apart."""
    runs = {tuple(prompt[i : i + run]) for i in range(len(prompt) - run + 1)}
    covered = [False] * len(output)
    for start in range(len(output) - run + 1):
        if tuple(output[start : start + run]) in runs:
            covered[start : start + run] = [True] * run
    return sum(covered) / len(output) if output else 0.0


def _row(task: str, method: str, runs: list[dict], reference: list[torch.Tensor] | None) -> dict:
    """One table row: `runs` of `method` over the task's prompts, against the greedy outputs `reference`."""
    tokens = sum(r["tokens"].numel() for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    decode_tokens = sum(r["tokens"].numel() - r["first_tokens"] for r in runs)
    decode_seconds = sum(r["seconds"] - r["first_token_seconds"] for r in runs)
    row = {"task": task, "method": method, "prompts": len(runs), "new_tokens": tokens, "seconds": seconds,
           "tokens_per_second": tokens / seconds, "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
           "decode_tokens_per_second": decode_tokens / decode_seconds if decode_tokens else None}
    if reference is not None:
        row["identical"] = sum(torch.equal(r["tokens"], ref) for r, ref in zip(runs, reference))
    if "drafted" in runs[0]:
        steps, drafted, accepted = (sum(r[key] for r in runs) for key in ("steps", "drafted", "accepted"))
        row.update(steps=steps, drafted=drafted, accepted=accepted, acceptance=accepted / drafted if drafted else 0.0,
                   tokens_per_step=tokens / steps if steps else 0.0)
    return row


def measure_generation(model, draft, prompts: dict[str, list[torch.Tensor]], options: SpeculativeOptions,
                       log=print) -> list[dict]:
    """Rows of tokens/s, acceptance and identity for every task and method; the methods run side by side on each
    prompt (greedy first: its output is the reference). A method `generate` refuses gets a row with its error."""
    rows = []
    methods = METHODS if draft is not None else METHODS[:2]  # no draft: greedy and prompt lookup
    for task, task_prompts in prompts.items():
        for method in methods:  # warm-up: the code paths of every method, on a few tokens
            with contextlib.suppress(ValueError, RuntimeError):
                generate_timed(model, task_prompts[0], method, options, draft, new_tokens=4)
        runs, errors = {m: [] for m in methods}, {}
        for ids in task_prompts:
            for method in methods:
                if method in errors:
                    continue
                try:
                    runs[method].append(generate_timed(model, ids, method, options, draft))
                except (ValueError, RuntimeError) as error:
                    errors[method] = " ".join(str(error).split())
        reference = [r["tokens"] for r in runs["greedy"]]
        copied = [copied_share(out.tolist(), ids[0].tolist()) for out, ids in zip(reference, task_prompts)]
        for method in methods:
            if method in errors:
                rows.append({"task": task, "method": method, "error": errors[method]})
                log(f"  {task:12s} {method:14s} failed: {errors[method]}")
                continue
            row = _row(task, method, runs[method], None if method == "greedy" else reference)
            if method == "greedy":
                row["copied"] = sum(copied) / len(copied)
            greedy = row if method == "greedy" else rows_greedy(rows, task)
            row["speedup"] = row["tokens_per_second"] / greedy["tokens_per_second"]
            row["decode_speedup"] = (row["decode_tokens_per_second"] / greedy["decode_tokens_per_second"]
                                     if row["decode_tokens_per_second"] and greedy["decode_tokens_per_second"]
                                     else None)
            rows.append(row)
            log(f"  {task:12s} {method:14s} {row['tokens_per_second']:7.1f} tokens/s ({row['speedup']:.2f}x)"
                + (f", acceptance {row['acceptance']:.0%}" if "acceptance" in row else "")
                + (f", identical {row['identical']}/{row['prompts']}" if "identical" in row else ""))
    return rows


def rows_greedy(rows: list[dict], task: str) -> dict:
    return next(r for r in rows if r["task"] == task and r["method"] == "greedy")


class FirstTokenTimer:
    """A `generate` streamer noting when the first new tokens arrive and how many (its first `put` is the prompt;
    assisted decoding puts every step's accepted tokens at once)."""

    def __init__(self):
        self.puts, self.first, self.first_tokens = 0, None, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first, self.first_tokens = time.perf_counter(), value.numel()

    def end(self) -> None:
        pass


def answer_timed(model, input_ids: torch.Tensor, tokens: int, cache=None, started: float | None = None) -> dict:
    """Greedy answer to `input_ids` (continuing `cache` when given): its tokens, the seconds to the first token
    and to the last, from `started` (default: now)."""
    timer = FirstTokenTimer()
    started = time.perf_counter() if started is None else started
    given = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=tokens, do_sample=False, streamer=timer, **given)
    return {"tokens": output[0, input_ids.shape[1] :], "first_token_seconds": timer.first - started,
            "seconds": time.perf_counter() - started}


def measure_document(model, document: torch.Tensor, question: torch.Tensor, state_path: Path,
                     options: SpeculativeOptions, log=print) -> dict:
    """Time to the first token of an answer about `document` [1, D]: re-reading it with the question, against
    continuing its saved state (the file read included); the state is made once by `prefill` and saved."""
    length, whole = document.shape[1], torch.cat([document, question], dim=1)
    model.prefill_piece_size = min(model.prefill_piece_size, length)  # `generate` reads the document in these pieces
    try:
        started = time.perf_counter()
        cache = model.prefill(document, piece_size=model.prefill_piece_size).cache
        read_seconds = time.perf_counter() - started
        started = time.perf_counter()
        save_cache(cache, state_path, model)
        save_seconds = time.perf_counter() - started
        del cache
        reread = answer_timed(model, whole, options.answer_tokens)
        started = time.perf_counter()
        loaded = load_cache(state_path, model)
        load_seconds = time.perf_counter() - started
        from_state = answer_timed(model, whole, options.answer_tokens, cache=loaded, started=started)
    finally:
        del model.prefill_piece_size  # back to the class's
    result = {
        "document_tokens": length, "question_tokens": question.shape[1], "answer_tokens": options.answer_tokens,
        "state_bytes": state_path.stat().st_size, "read_and_state_seconds": read_seconds,
        "save_seconds": save_seconds, "load_seconds": load_seconds,
        "reread_first_token_seconds": reread["first_token_seconds"], "reread_seconds": reread["seconds"],
        "state_first_token_seconds": from_state["first_token_seconds"], "state_seconds": from_state["seconds"],
        "speedup": reread["first_token_seconds"] / from_state["first_token_seconds"],
        "same_answer": bool(torch.equal(reread["tokens"], from_state["tokens"])),
    }
    log(f"  document {length} tokens: first token {result['reread_first_token_seconds']:.2f} s re-reading, "
        f"{result['state_first_token_seconds']:.3f} s from the saved state ({human_bytes(result['state_bytes'])}, "
        f"{result['speedup']:.0f}x); same answer: {result['same_answer']}")
    return result


def measure(models: dict, tokenizer, texts: list[str], options: SpeculativeOptions, output: Path, log=print) -> dict:
    """Every task on every model. `models`: name -> (model, draft, description)."""
    tasks = options.validate()
    passages = heldout_passages(tokenizer, texts, options.passages, options.passage_tokens)
    prompts = {}
    if "grounded" in tasks:
        prompts["grounded"] = [quote_prompt(tokenizer, p) for p in passages]
    if "continuation" in tasks:
        prompts["continuation"] = [_ids(tokenizer, p) for p in passages]
    results = {}
    for name, (model, draft, description) in models.items():
        log(f"{name}: {description}")
        layer_types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
        result = {"description": description, "layers": len(layer_types),
                  "softmax_layers": sum(kind != "linear_attention" for kind in layer_types),
                  "draft": draft_description(draft, options)}
        result["generation"] = measure_generation(model, draft, prompts, options, log) if prompts else []
        if "document" in tasks and name != "teacher":  # saved states are the delta models' (`save_cache`)
            document, question = document_and_question(tokenizer, texts, options.document_tokens)
            result["document"] = measure_document(model, document, question, output / f"{name}.state.safetensors",
                                                  options, log)
            (output / f"{name}.state.safetensors").unlink()
        results[name] = result
    return results


def draft_description(draft, options: SpeculativeOptions) -> str:
    if draft is None:
        return "none (greedy and prompt lookup only)"
    if options.assistant_model:
        return f"{options.assistant_model}, {options.draft_tokens} tokens per step"
    return (f"the target's first {draft.config.num_hidden_layers} layers (early exit), {options.draft_tokens} tokens "
            "per step")


# ----------------------------------------------------------------------------------------------- report


def markdown_tables(report: dict) -> list[str]:
    """The generation and saved-state tables and the target checks, as markdown lines."""
    options = report["options"]
    lines = [f"Speculative decoding: greedy, up to {options['new_tokens']} new tokens per prompt, "
             f"{options['passages']} held-out passages of {options['passage_tokens']} tokens per task; prompt lookup "
             f"drafts {options['lookup_tokens']} tokens ({options['lookup_ngram']}-gram match).", "",
             f"Copied: the share of the greedy answer's tokens in a run of {COPY_RUN} or more tokens found in the "
             "prompt (a looping answer has its drafts accepted too, from its own tokens).", "",
             "Tokens/s counts every new token over the whole `generate` call, prefill included; after the first "
             "step: the tokens after the first step's over the time after it (decoding alone; the first step is the "
             "prefill, and for prompt lookup and the assistant the first verification too).", "",
             "| model | task | method | tokens/s | vs greedy | after the first step: tokens/s | vs greedy | acceptance "
             "| tokens per step | identical to greedy | copied |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, result in report["models"].items():
        for row in result["generation"]:
            if "error" in row:
                lines.append(f"| {name} | {row['task']} | {row['method']} | failed: {row['error']} | | | | | | | |")
                continue
            acceptance = f"{row['acceptance']:.0%}" if "acceptance" in row else "-"
            per_step = f"{row['tokens_per_step']:.2f}" if "tokens_per_step" in row else "-"
            identical = f"{row['identical']}/{row['prompts']}" if "identical" in row else "(reference)"
            copied = f"{row['copied']:.0%}" if "copied" in row else "-"
            decode = f"{row['decode_tokens_per_second']:.1f}" if row.get("decode_tokens_per_second") else "-"
            decode_speedup = f"{row['decode_speedup']:.2f}x" if row.get("decode_speedup") else "-"
            lines.append(f"| {name} | {row['task']} | {row['method']} | {row['tokens_per_second']:.1f} | "
                         f"{row['speedup']:.2f}x | {decode} | {decode_speedup} | {acceptance} | {per_step} | "
                         f"{identical} | {copied} |")
    lines += ["", "Assistants: " + "; ".join(f"{name}: {r['draft']}" for name, r in report["models"].items()), ""]
    documents = {name: r["document"] for name, r in report["models"].items() if "document" in r}
    if documents:
        lines += ["Answering about a long document: time to the first token, re-reading the document with the "
                  "question vs continuing its saved state (`load_cache`, file read included):", "",
                  "| model | document tokens | state file | re-read | from saved state | speed-up | same answer |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for name, d in documents.items():
            lines.append(f"| {name} | {d['document_tokens']:,} | {human_bytes(d['state_bytes'])} | "
                         f"{d['reread_first_token_seconds']:.2f} s | {d['state_first_token_seconds']:.3f} s | "
                         f"{d['speedup']:.0f}x | {'yes' if d['same_answer'] else 'no'} |")
        lines.append("")
    checks = target_checks(report)
    if checks:
        lines += ["Targets:", ""] + checks
    return lines


def target_checks(report: dict) -> list[str]:
    """The issue's targets, met or not, per model."""
    checks = []
    for name, result in report["models"].items():
        rows = {(r["task"], r["method"]): r for r in result["generation"] if "error" not in r}
        grounded, free = rows.get(("grounded", "prompt lookup")), rows.get(("continuation", "prompt lookup"))
        if name == "teacher":  # the peer, not a target
            checks += [f"- (peer) teacher: prompt lookup on the {row['task']} task {row['speedup']:.2f}x greedy, "
                       f"acceptance {row['acceptance']:.0%}" for row in (grounded, free) if row]
            continue
        if grounded:
            ok = grounded["speedup"] >= 2 and grounded["identical"] == grounded["prompts"]
            after = (f"; after the first step {grounded['decode_speedup']:.2f}x" if grounded.get("decode_speedup")
                     else "")
            checks.append(f"- [{'x' if ok else ' '}] {name}: prompt lookup on the grounded task "
                          f"{grounded['speedup']:.2f}x greedy, {grounded['identical']}/{grounded['prompts']} identical "
                          f"(target >= 2x, identical; tokens/s of the whole call{after})")
        if free:
            checks.append(f"- [{'x' if free['speedup'] >= 0.9 else ' '}] {name}: prompt lookup on free continuation "
                          f"{free['speedup']:.2f}x greedy (target >= 0.9x)")
        if "document" in result:
            d = result["document"]
            checks.append(f"- [{'x' if d['speedup'] >= 20 else ' '}] {name}: first token from the saved "
                          f"{d['document_tokens']:,}-token state {d['speedup']:.0f}x faster than re-reading "
                          "(target >= 20x)")
    return checks


def plot(report: dict, path: Path) -> None:
    """Tokens/s per task and method; time to first token, re-read vs saved state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    groups = [(name, task) for name, r in report["models"].items()
              for task in dict.fromkeys(row["task"] for row in r["generation"])]
    width = 0.8 / len(METHODS)
    for offset, method in enumerate(METHODS):
        heights = []
        for name, task in groups:
            row = next((r for r in report["models"][name]["generation"] if r["task"] == task and r["method"] == method
                        and "error" not in r), None)
            heights.append(row["tokens_per_second"] if row else 0.0)
        left.bar([i + offset * width for i in range(len(groups))], heights, width, label=method)
    left.set_xticks([i + width for i in range(len(groups))], [f"{name}\n{task}" for name, task in groups], fontsize=8)
    left.set(ylabel="tokens / s", title="greedy vs prompt lookup vs assistant")
    left.legend(fontsize=8)
    documents = {name: r["document"] for name, r in report["models"].items() if "document" in r}
    for offset, (key, label) in enumerate((("reread_first_token_seconds", "re-read"),
                                           ("state_first_token_seconds", "saved state"))):
        right.bar([i + offset * 0.4 for i in range(len(documents))], [d[key] for d in documents.values()], 0.4,
                  label=label)
    right.set_xticks([i + 0.2 for i in range(len(documents))], list(documents), fontsize=8)
    right.set(yscale="log", ylabel="seconds to the first token", title="answer about a long document")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.grid(alpha=0.3, axis="y")
    figure.suptitle(f"delta-attention speculative decoding and saved states ({report['environment']['threads']} "
                    "threads)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------- command


def _model_folder(layout: str, options: SpeculativeOptions, output: Path, log=print) -> Path:
    """The converted model of `layout`: the folder given, or one converted here (reused while it was converted with
    today's options, `convert`'s defaults included; converted again otherwise)."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert
    from delta_attention.conversion.data.assets import smollm2_gguf_path

    from .bench_distill import LAYOUTS
    from .resumable import conversion_options, converted_options, option_changes

    given = options.hybrid_model if layout == "hybrid" else options.delta_model
    if given:
        return Path(given)
    folder = output / "models" / layout
    settings = ConversionSettings(keep_attention=LAYOUTS[layout], dtype="float32")
    found, wanted = converted_options(folder), conversion_options(settings)
    if found != wanted:
        if found is not None:
            log(f"{folder} was converted with other options ({option_changes(found, wanted)}): converting it again")
        log(f"converting the offline SmolLM2 GGUF to the {layout} model (keep attention {LAYOUTS[layout]}, calibrated)")
        convert(str(smollm2_gguf_path()), out=folder, overwrite=folder.exists(), settings=settings)
    return folder


def run_speculative(options: SpeculativeOptions, log=print) -> dict:
    """Load or convert the models, measure every task, write the JSON, markdown and PNG; returns the report."""
    from delta_attention.conversion.data.assets import heldout_texts
    from delta_attention.conversion.loading import check_model_spec, load_model

    from .benchmark import _environment

    options.validate()
    layouts = [name.strip() for name in options.layouts.split(",") if name.strip()]
    known = ("hybrid", "all-delta", "teacher", "hybrid+packed", "all-delta+packed")
    if not layouts or set(layouts) - set(known):
        raise ValueError(f"--layouts must be a comma-separated subset of {', '.join(known)}, got "
                         f"{options.layouts!r}")
    for flag in ("hybrid_model", "delta_model", "teacher_model", "assistant_model"):  # before any conversion or loading
        if getattr(options, flag):
            check_model_spec(getattr(options, flag), f"--{flag}")
    output = Path(options.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    if options.threads:
        torch.set_num_threads(options.threads)
    try:
        dtype = getattr(torch, options.dtype)
        started = time.perf_counter()
        assistant = load_model(options.assistant_model, dtype=dtype, tokenizer=False)[0] if options.assistant_model \
            else None
        models, tokenizer = {}, None
        for layout in layouts:
            if layout == "teacher":
                from delta_attention.conversion.data.assets import smollm2_gguf_path

                spec = options.teacher_model or str(smollm2_gguf_path())
                model, tokenizer = load_model(spec, dtype=dtype, what="--teacher_model")
                models[layout] = (model, None, f"the source model ({Path(spec).name}), not converted")
                continue
            base, packed = layout.removesuffix("+packed"), layout.endswith("+packed")
            model, tokenizer = load_model(_model_folder(base, options, output, log), dtype=dtype, require_delta=True)
            draft = assistant if assistant is not None else early_exit_draft(model, options.draft_layers)
            description = f"{base} conversion of SmolLM2-135M-Instruct"
            if packed:
                description += f", packed weights (+{model.pack_linear_weights() / 2**20:.0f} MiB)"
            models[layout] = (model, draft, description)
        report = {"environment": _environment(), "options": dataclasses.asdict(options), "command": _command()}
        report["models"] = measure(models, tokenizer, heldout_texts(), options, output, log)
        report["seconds"] = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads_before)
    write_report(report, output, log)
    return report


def _command() -> str:
    """The command line that ran this (through `bench-speculative` or `benchmark --parts speculative`)."""
    args = sys.argv[1:]
    if args[:1] in (["bench-speculative"], ["benchmark"]):
        return "delta-attention " + shlex.join(args)
    return "delta-attention bench-speculative " + shlex.join(args)


def write_report(report: dict, output: Path, log=print) -> None:
    """`speculative.json`, `speculative.md` and `speculative.png` under `output`."""
    (output / "speculative.json").write_text(json.dumps(report, indent=1))
    text = "\n".join(markdown_tables(report) + ["", f"Reproduce: `{report['command']}`"])
    (output / "speculative.md").write_text(text + "\n")
    try:
        plot(report, output / "speculative.png")
    except ImportError:
        log("matplotlib is not installed (pip install delta-attention[bench]): no plot written")
    log("\n" + text)
    log(f"\nwrote {output / 'speculative.json'}, {output / 'speculative.md'}, {output / 'speculative.png'}")


Options = SpeculativeOptions


def run(options: SpeculativeOptions) -> int:
    run_speculative(options)
    return 0


if __name__ == "__main__":
    from delta_attention.scripts.cli import main

    sys.exit(main(["bench-speculative", *sys.argv[1:]]))
