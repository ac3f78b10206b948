"""`evaluate`: perplexity, passkey retrieval, decode speed and cache memory of a model (and a teacher side by
side), written as one JSON and one markdown report per run."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from .agreement import (DEFAULT_AGREEMENT_DATASET, AgreementSettings, agreement_inputs, agreement_markdown,
                        compare_outputs, model_outputs)
from .long_context import (DEFAULT_BUCKETS, DEFAULT_RESET_WINDOW, check_long_context_options, long_context_markdown,
                           long_perplexity, parse_buckets, parse_depths, trained_context)
from .peak_memory import task_peak_memory
from .perplexity import perplexity_of_texts
from .tasks import decode_speed, mean_over_depths, passkey_grid
from ..loading import check_model_spec, load_model
from ..data.text import evaluation_texts, source_list

TASKS = ("perplexity", "long_ppl", "passkey", "speed", "agreement")


@dataclasses.dataclass
class EvaluateOptions:
    """What to evaluate and how."""

    model: str = dataclasses.field(default=None, metadata={"help": "model folder, Hub id or .gguf", "positional": True})
    teacher: str | None = dataclasses.field(default=None, metadata={"help": "a second model evaluated side by side"})
    tasks: str = dataclasses.field(default="perplexity,long_ppl,passkey,speed",
                                   metadata={"help": f"comma-separated: {TASKS}"})
    dataset: str = dataclasses.field(default="builtin:heldout,builtin:crossdomain", metadata={
        "help": "texts for perplexity: one set, or several comma-separated (one row each: in-domain held-out and "
                "cross-domain by default; builtin:heldout:sotu,brown is one set of two corpora); long_ppl reads the "
                "first"})
    text_column: str = dataclasses.field(default="text", metadata={"help": "column holding the text"})
    max_tokens: int = dataclasses.field(default=16_384, metadata={"help": "tokens scored for perplexity (0 = all)"})
    window: int = dataclasses.field(default=1024, metadata={"help": "perplexity window"})
    stride: int = dataclasses.field(default=512, metadata={"help": "perplexity stride (< window)"})
    long_max_tokens: int = dataclasses.field(default=65_536, metadata={
        "help": "long_ppl: tokens of the texts joined into one document (fewer if the texts run out)"})
    long_buckets: str = dataclasses.field(default=DEFAULT_BUCKETS, metadata={
        "help": "long_ppl: edges of the position buckets (0,2048,... = 0-2k, 2k-8k, ...)"})
    long_piece: int = dataclasses.field(default=1024, metadata={
        "help": "long_ppl: tokens per forward call, the cache carried between them"})
    long_reset_window: int = dataclasses.field(default=DEFAULT_RESET_WINDOW, metadata={
        "help": "long_ppl: also read the document in independent windows of this many tokens (each from an empty "
                "cache) and report per bucket whole / reset perplexity: does the longer context help? (0 = off)"})
    passkey_lengths: str = dataclasses.field(default="1024,4096,16384,65536",
                                             metadata={"help": "prompt lengths in tokens"})
    passkey_depths: str = dataclasses.field(default="0.1,0.5,0.9", metadata={"help": "relative needle depths"})
    passkey_trials: int = dataclasses.field(default=1, metadata={"help": "prompts per length and depth"})
    speed_contexts: str = dataclasses.field(default="1024,4096,16384", metadata={"help": "contexts for decode speed"})
    speed_new_tokens: int = dataclasses.field(default=16, metadata={"help": "decode steps timed per context"})
    agreement_dataset: str = dataclasses.field(default=DEFAULT_AGREEMENT_DATASET, metadata={
        "help": "texts for agreement with --teacher (top-1, greedy continuations); same forms as --dataset"})
    agreement_tokens: int = dataclasses.field(default=8192, metadata={"help": "teacher-forced positions compared"})
    agreement_seq_len: int = dataclasses.field(default=512, metadata={"help": "teacher-forced window length"})
    agreement_prompts: int = dataclasses.field(default=16, metadata={"help": "greedy-continuation prompts"})
    agreement_prompt_tokens: int = dataclasses.field(default=48, metadata={"help": "tokens per continuation prompt"})
    agreement_new_tokens: int = dataclasses.field(default=32, metadata={"help": "greedy tokens per continuation"})
    answer_tokens: int = dataclasses.field(default=64, metadata={"help": "most new tokens of a chat-prompt answer"})
    agreement_samples: int = dataclasses.field(default=4, metadata={
        "help": "sampled answers per chat prompt for the sampled repetition rate (the mean over all)"})
    output_dir: str = dataclasses.field(default="evaluation", metadata={"help": "where report.json/report.md go"})
    bf16: bool = dataclasses.field(default=False, metadata={"help": "run the models in bfloat16"})
    seed: int = dataclasses.field(default=0, metadata={
        "help": "seed of passkeys, speed prompts and sampled agreement answers"})


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def load_model_and_tokenizer(spec: str, dtype: torch.dtype = torch.float32):
    """A causal LM and its tokenizer from a folder, Hub id or `.gguf` file (delta models included)."""
    return load_model(spec, dtype=dtype)


def set_perplexity(model, tokenizer, groups: list[list[str]], window: int, stride: int,
                   max_tokens: int | None = None) -> dict:
    """Perplexity of one evaluation set given as groups of texts (`evaluation_texts`: one group per corpus of a
    built-in set): each group scores `max_tokens / len(groups)` tokens (`perplexity_of_texts`), so the corpora
    weigh the same; the NLL is averaged over every scored token."""
    share = max_tokens // len(groups) if max_tokens else None
    parts = [perplexity_of_texts(model, tokenizer, texts, window, stride, share) for texts in groups]
    tokens = sum(part["tokens"] for part in parts)
    nll = sum(part["nll"] * part["tokens"] for part in parts) / tokens
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": tokens}


def evaluate_model(model, tokenizer, options: EvaluateOptions, texts: list[str] | None,
                   perplexity_sets: dict[str, list[list[str]]] | None = None) -> dict:
    """Every task asked for, on one model. `perplexity_sets` (set name -> groups of texts) gives one perplexity
    per set (`perplexity_sets` of the result; `perplexity` is the first set's); without it, `texts` is the one
    set."""
    tasks = [t.strip() for t in options.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    device = next(model.parameters()).device
    result = {"max_position_embeddings": trained_context(model)}
    if "perplexity" in tasks:
        with task_peak_memory(result, "perplexity", device):
            sets = perplexity_sets or {options.dataset: [texts]}
            result["perplexity_sets"] = {name: set_perplexity(model, tokenizer, groups, options.window, options.stride,
                                                              options.max_tokens or None)
                                         for name, groups in sets.items()}
            result["perplexity"] = next(iter(result["perplexity_sets"].values()))
    if "long_ppl" in tasks:
        with task_peak_memory(result, "long_ppl", device):
            result["long_ppl"] = long_perplexity(model, tokenizer, texts, options.long_max_tokens,
                                                 parse_buckets(options.long_buckets), options.long_piece,
                                                 reset_window=options.long_reset_window)
    if "passkey" in tasks:
        with task_peak_memory(result, "passkey", device):
            depths = parse_depths(options.passkey_depths)
            grid = passkey_grid(model, tokenizer, _ints(options.passkey_lengths), depths, options.passkey_trials,
                                options.seed)
        result["passkey"], result["passkey_by_depth"] = mean_over_depths(grid), grid
    if "speed" in tasks:
        with task_peak_memory(result, "speed", device):
            result["speed"] = [decode_speed(model, c, options.speed_new_tokens, seed=options.seed)
                               for c in _ints(options.speed_contexts)]
    return result


def agreement_settings(options: EvaluateOptions) -> AgreementSettings:
    """The `agreement` task's settings from the options."""
    return AgreementSettings(seq_len=options.agreement_seq_len, tokens=options.agreement_tokens,
                             prompts=options.agreement_prompts, prompt_tokens=options.agreement_prompt_tokens,
                             new_tokens=options.agreement_new_tokens, answer_tokens=options.answer_tokens,
                             samples=options.agreement_samples, seed=options.seed).validate()


def markdown_report(report: dict) -> str:
    """The report as markdown tables, one column per model."""
    names = list(report["models"])
    results = [report["models"][n] for n in names]
    head = "| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    lines = [f"# Evaluation ({report['date']})", ""]
    if all("perplexity" in r for r in results):
        lines += ["## Perplexity", "", f"window {report['window']}, stride {report['stride']}; one row per set "
                  "(`builtin:heldout`: held-out documents of the training corpora; `builtin:crossdomain`: corpora of "
                  "other domains and eras held out of training whole)", "",
                  head + perplexity_rows(results, teacher=len(results) > 1), ""]
    if all("passkey" in r for r in results):
        rows = "".join(f"| {length} tokens | " + " | ".join(f"{r['passkey'][length]:.0%}" for r in results) + " |\n"
                       for length in results[0]["passkey"])
        lines += ["## Passkey retrieval accuracy", "", head + rows]
    if all("speed" in r for r in results):
        rows = "".join(
            f"| {s['context']:,} | " + " | ".join(
                f"{r['speed'][i]['ms_per_token']:.1f} ms, {r['speed'][i]['cache_bytes'] / 2**20:.1f} MiB" for r in results
            ) + " |\n" for i, s in enumerate(results[0]["speed"]))
        lines += ["## Decode speed and cache memory", "", "| context | " + " | ".join(names) + " |\n|---|"
                  + "---|" * len(names) + "\n" + rows]
    lines += long_context_markdown(names, results)
    if "agreement" in report:
        lines += [agreement_markdown(report["agreement"], student=names[0], teacher=names[-1])]
    return "\n".join(lines)


def perplexity_rows(results: list[dict], teacher: bool) -> str:
    """Markdown rows (one column per model) of the perplexity of each set, its scored tokens and, with a teacher
    (the last model), each model's ratio to the teacher's perplexity on that set."""
    sets = results[0].get("perplexity_sets") or {"perplexity": results[0]["perplexity"]}
    rows = []
    for name in sets:
        scores = [(r.get("perplexity_sets") or {"perplexity": r["perplexity"]})[name] for r in results]
        label = f"`{name}`" if name != "perplexity" else "perplexity"
        rows.append(f"| {label} | " + " | ".join(f"{s['perplexity']:.2f}" for s in scores) + " |")
        if teacher:
            rows.append(f"| {label} vs teacher | "
                        + " | ".join(f"{s['perplexity'] / scores[-1]['perplexity']:.2f}x" for s in scores) + " |")
        rows.append(f"| {label} tokens | " + " | ".join(f"{s['tokens']:,}" for s in scores) + " |")
    return "\n".join(rows)


def run_evaluate(options: EvaluateOptions) -> dict:
    """Evaluate the model (and the teacher); writes `report.json` and `report.md` under `output_dir`."""
    if not options.model:
        raise ValueError("give the model: delta-attention evaluate MODEL [--teacher SOURCE]")
    check_model_spec(options.model)
    check_long_context_options(options)
    if options.teacher:
        check_model_spec(options.teacher, "teacher")
    agreement = "agreement" in [t.strip() for t in options.tasks.split(",")]
    if agreement and not options.teacher:
        raise ValueError("the agreement task compares the model with a teacher; pass --teacher SOURCE "
                         "(or leave agreement out of --tasks)")
    settings = agreement_settings(options) if agreement else None
    dtype = torch.bfloat16 if options.bf16 else torch.float32
    texts = perplexity_sets = None
    if "perplexity" in options.tasks or "long_ppl" in options.tasks:
        names = source_list(options.dataset)
        perplexity_sets = {name: evaluation_texts(name, options.text_column) for name in names}
        texts = [text for group in perplexity_sets[names[0]] for text in group]
    if agreement:
        evaluation_texts(options.agreement_dataset)  # a source that does not load fails before any model does
    outputs, inputs = [], None  # agreement: the model's outputs, then the teacher's
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "dataset": options.dataset, "window": options.window,
              "stride": options.stride, "threads": torch.get_num_threads(), "models": {}}
    for spec in [options.model] + ([options.teacher] if options.teacher else []):
        model, tokenizer = load_model_and_tokenizer(spec, dtype)
        report["models"][Path(str(spec)).name or str(spec)] = evaluate_model(model, tokenizer, options, texts,
                                                                             perplexity_sets)
        if agreement:  # both models get the inputs cut with the first model's tokenizer
            inputs = inputs or agreement_inputs(tokenizer, options.agreement_dataset, settings)
            outputs.append(model_outputs(model, tokenizer, inputs, settings, Path(str(spec)).name or str(spec)))
        del model
    if agreement:
        report["agreement"] = compare_outputs(outputs[0], outputs[1], inputs, settings,
                                              options.agreement_dataset)
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown_report(report))
    return report
