"""Generation-based agreement of a student with its teacher: how often they predict, continue and answer alike.

Four measures, every one on inputs that both models get identically:

* **teacher-forced top-1 agreement**: over fixed held-out windows, the share of positions where the student's
  most likely next token (argmax of its logits) is the teacher's;
* **greedy-continuation agreement**: `prompts` prompts of `prompt_tokens` tokens cut from held-out text, each
  continued greedily for `new_tokens` tokens by both models (never stopping at EOS); the mean length of the
  prefix on which the two continuations are identical, and the share of continuations identical throughout;
* **repetition rate** of answers to a fixed list of chat prompts (`CHAT_PROMPTS`, rendered with the chat
  template when the tokenizer has one), greedy and sampled: for one answer, the share of its word n-grams
  (`REPETITION_NGRAM` = 3 words; words are the runs of letters/digits of the lowercased text) that repeat an
  n-gram seen earlier in the same answer, i.e. `1 - distinct / total`; 0 for an answer shorter than n words;
  the rate of a set of answers is the mean over the answers (the sampled set: `samples` answers per prompt);
* the teacher's and the student's greedy answers to the same prompts, side by side (`agreement_markdown`);
* **in-context copying**, of each model alone: the first `copy_windows` teacher-forced windows, cut to `copy_tokens`
  tokens, are each read twice in a row, and the copy accuracy is the share of positions of the second reading
  (after its first token) where the model's top-1 prediction is the next token of the text it has already seen:
  the induction that quoting, retrieval and prompt-lookup decoding rely on.

Per-model work (`model_outputs`) is separate from the comparison (`compare_outputs`), so `evaluate` can load
one model at a time; `measure_agreement` does both for two loaded models (`distill`).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from tqdm.auto import tqdm

from ..data.text import evaluation_windows

#: text agreement is measured on unless told otherwise: the corpora held out whole (other domains and eras)
DEFAULT_AGREEMENT_DATASET = "builtin:crossdomain"

#: words per n-gram of the repetition rate
REPETITION_NGRAM = 3

#: sampling of the "sampled" answers (top-k off)
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}

#: the fixed chat prompts both models answer
CHAT_PROMPTS = (
    "Write a short list of three fruits.",
    "What is the capital of France?",
    "Explain in one sentence why the sky is blue.",
    "Give me two tips for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What is 12 plus 7?",
    "Write a haiku about the sea.",
    "Name three colours of the rainbow.",
    "How many days are there in a week?",
    "Suggest a name for a pet cat.",
    "Describe a bicycle to a child in two sentences.",
    "Write one sentence that a birthday card could say.",
)


@dataclasses.dataclass
class AgreementSettings:
    """How much text and how many tokens each measure uses."""

    seq_len: int = 512  # teacher-forced window length
    tokens: int = 8192  # teacher-forced positions: tokens // seq_len windows
    prompts: int = 16  # greedy-continuation prompts
    prompt_tokens: int = 48
    new_tokens: int = 32  # greedy continuation length
    answer_tokens: int = 64  # most new tokens of a chat answer
    batch_size: int = 16
    seed: int = 0  # seed of the sampled answers
    samples: int = 4  # sampled answers per prompt (with one, a model's rate ranged 3.0-10.6% over three seeds)
    copy_windows: int = 4  # passages read twice for the copy accuracy (the first teacher-forced windows)
    copy_tokens: int = 128  # tokens per passage (seq_len when it is shorter)

    def validate(self) -> AgreementSettings:
        """Raise a `ValueError` naming the setting that cannot work."""
        for name in ("seq_len", "prompt_tokens", "copy_tokens"):
            if getattr(self, name) < 2:
                raise ValueError(f"agreement {name} must be at least 2, got {getattr(self, name)}")
        for name in ("tokens", "prompts", "new_tokens", "answer_tokens", "batch_size", "copy_windows", "samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"agreement {name} must be at least 1, got {getattr(self, name)}")
        return self


@dataclasses.dataclass
class AgreementInputs:
    """What both models are given: teacher-forced windows, continuation prompts and chat prompt ids."""

    windows: torch.Tensor  # [num_windows, seq_len]
    prompts: torch.Tensor  # [num_prompts, prompt_tokens]
    chat_prompts: list[str]
    chat_ids: list[list[int]]


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of `prompt` as one user turn through the tokenizer's chat template (with the assistant's
    generation prompt), or of the plain prompt when the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def agreement_inputs(tokenizer, source: str, settings: AgreementSettings,
                     chat_prompts: tuple[str, ...] = CHAT_PROMPTS) -> AgreementInputs:
    """The inputs of every measure, cut from the texts of `source` (any `--dataset` form; a built-in set's corpora
    weigh the same) with `evaluation_windows`: the same arguments give the same inputs."""
    settings.validate()
    windows = evaluation_windows(source, tokenizer, settings.seq_len, max(1, settings.tokens // settings.seq_len))
    prompts = evaluation_windows(source, tokenizer, settings.prompt_tokens, settings.prompts)
    return AgreementInputs(windows, prompts, list(chat_prompts), [chat_prompt_ids(tokenizer, p) for p in chat_prompts])


# ----------------------------------------------------------------------------------------------- per model


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def top1_predictions(model, windows: torch.Tensor, batch_size: int = 4, desc: str | None = None) -> torch.Tensor:
    """`[N, L]` argmax of the model's next-token logits at every position of `windows` `[N, L]` (no cache)."""
    device = _device(model)
    predictions = []
    for start in tqdm(range(0, len(windows), batch_size), desc=desc, disable=desc is None, leave=False):
        logits = model(input_ids=windows[start : start + batch_size].to(device), use_cache=False).logits  # [B, L, V]
        predictions.append(logits.argmax(-1).cpu())
    return torch.cat(predictions)


def repeated_passages(windows: torch.Tensor, count: int, tokens: int) -> torch.Tensor:
    """`[n, 2 * tokens]`: the first `tokens` tokens of the first `count` of `windows` `[N, L]`, each twice in a row
    (n = min(count, N))."""
    passages = windows[:count, :tokens]
    return torch.cat([passages, passages], dim=1)


def copy_accuracy(predictions: torch.Tensor, repeated: torch.Tensor) -> float:
    """Share of the second reading's predictions, past its first token, that are the passage's next token:
    `predictions` `[n, 2T]` are the top-1 next tokens at each position of `repeated` `[n, 2T]`, and positions
    T .. 2T - 2 should predict tokens T + 1 .. 2T - 1 (T - 1 per passage)."""
    tokens = repeated.shape[1] // 2
    return (predictions[:, tokens:-1] == repeated[:, tokens + 1:]).double().mean().item()


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, new_tokens: int, batch_size: int = 16, use_cache: bool = True,
                         desc: str | None = None) -> torch.Tensor:
    """`[N, new_tokens]` greedy continuation of each prompt `[N, P]` (prompts of one length: no padding).

    Every continuation has `new_tokens` tokens: EOS is a token like any other. With `use_cache` the prompt is
    run once and each step feeds one token through the cache; without, every step reruns the whole sequence
    (the plain reference).
    """
    device = _device(model)
    continued = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None, leave=False):
        ids = prompts[start : start + batch_size].to(device)  # [B, P]
        tokens = []  # new_tokens x [B, 1]
        out = model(input_ids=ids, use_cache=use_cache, logits_to_keep=1)
        for step in range(new_tokens):
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            if step + 1 == new_tokens:
                break
            if use_cache:
                out = model(input_ids=tokens[-1], cache=out.cache, use_cache=True, logits_to_keep=1)
            else:
                out = model(input_ids=torch.cat([ids, *tokens], dim=1), use_cache=False, logits_to_keep=1)
        continued.append(torch.cat(tokens, dim=1).cpu())
    return torch.cat(continued)


@torch.no_grad()
def answer_prompts(model, tokenizer, chat_ids: list[list[int]], max_new_tokens: int, sample: bool = False,
                   seed: int = 0, batch_size: int = 16, desc: str | None = None) -> list[str]:
    """The decoded answers (new tokens only, special tokens dropped) to prompts given as token ids.

    Prompts run in left-padded batches through `generate`, which stops a row at EOS; greedy, or sampled with
    `SAMPLING` from `seed` (the same seed and batch size give the same answers)."""
    device = _device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    options = dict(do_sample=True, **SAMPLING) if sample else dict(do_sample=False)
    answers = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the caller's RNG is untouched
        torch.manual_seed(seed)
        for start in tqdm(range(0, len(chat_ids), batch_size), desc=desc, disable=desc is None, leave=False):
            rows = chat_ids[start : start + batch_size]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # [B, width], left-padded
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, **options)
            answers += [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]
    return answers


def model_outputs(model, tokenizer, inputs: AgreementInputs, settings: AgreementSettings, name: str = "model") -> dict:
    """Everything agreement compares, for one model: top-1 predictions, greedy continuations, greedy and
    sampled chat answers (`settings.samples` per prompt: every prompt once, then again, ...). The model is put in
    eval mode for the measurement and back as it was."""
    was_training = model.training
    model.eval()
    try:
        batch = settings.batch_size
        return {
            "top1": top1_predictions(model, inputs.windows, min(batch, 4), desc=f"{name}: top-1"),
            "copy": top1_predictions(model, repeated_passages(inputs.windows, settings.copy_windows,
                                                              settings.copy_tokens), min(batch, 4)),
            "continuations": greedy_continuations(model, inputs.prompts, settings.new_tokens, batch,
                                                  desc=f"{name}: continuations"),
            "greedy": answer_prompts(model, tokenizer, inputs.chat_ids, settings.answer_tokens, False,
                                     batch_size=batch, desc=f"{name}: greedy answers"),
            "sampled": answer_prompts(model, tokenizer, inputs.chat_ids * settings.samples, settings.answer_tokens,
                                      True, settings.seed, batch_size=batch, desc=f"{name}: sampled answers"),
        }
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------------------- comparison


def top1_agreement(student_top1: torch.Tensor, teacher_top1: torch.Tensor) -> float:
    """Share of positions where the two `[N, L]` argmax tensors agree."""
    if student_top1.shape != teacher_top1.shape:
        raise ValueError(f"top-1 predictions of different shapes: {tuple(student_top1.shape)} vs "
                         f"{tuple(teacher_top1.shape)}")
    return (student_top1 == teacher_top1).double().mean().item()


def matching_prefix_lengths(student_tokens: torch.Tensor, teacher_tokens: torch.Tensor) -> torch.Tensor:
    """`[N]` number of leading tokens on which two `[N, M]` continuations are identical (M when all are)."""
    same = (student_tokens == teacher_tokens).long()  # [N, M]
    return same.cumprod(dim=1).sum(dim=1)


def continuation_agreement(student_tokens: torch.Tensor, teacher_tokens: torch.Tensor) -> dict:
    """Mean matching prefix (tokens) and the share of fully identical continuations."""
    lengths = matching_prefix_lengths(student_tokens, teacher_tokens)
    return {"mean_matching_prefix": lengths.double().mean().item(),
            "full_match": (lengths == student_tokens.shape[1]).double().mean().item()}


def repetition_of_answer(text: str, n: int = REPETITION_NGRAM) -> float:
    """Share of the word n-grams of `text` that repeat an earlier one (`1 - distinct / total`); 0 below n words."""
    words = re.findall(r"\w+", text.lower())
    ngrams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not ngrams:
        return 0.0
    return 1.0 - len(set(ngrams)) / len(ngrams)


def repetition_rate(answers: list[str], n: int = REPETITION_NGRAM) -> float:
    """Mean `repetition_of_answer` over `answers`."""
    if not answers:
        raise ValueError("no answers to measure the repetition rate of")
    return sum(repetition_of_answer(a, n) for a in answers) / len(answers)


def compare_outputs(student: dict, teacher: dict, inputs: AgreementInputs, settings: AgreementSettings,
                    dataset: str) -> dict:
    """The agreement record (JSON-ready) from the `model_outputs` of the student and the teacher."""
    repeated = repeated_passages(inputs.windows, settings.copy_windows, settings.copy_tokens)
    return {
        "dataset": dataset,
        "top1_agreement": top1_agreement(student["top1"], teacher["top1"]),
        "positions": int(teacher["top1"].numel()),
        "continuation": {"prompts": len(inputs.prompts), "prompt_tokens": settings.prompt_tokens,
                         "new_tokens": settings.new_tokens,
                         **continuation_agreement(student["continuations"], teacher["continuations"])},
        "copy": {"passages": len(repeated), "tokens": repeated.shape[1] // 2,
                 **{who: copy_accuracy(outputs["copy"], repeated)
                    for who, outputs in (("teacher", teacher), ("student", student))}},
        "repetition": {"ngram": REPETITION_NGRAM, "answer_tokens": settings.answer_tokens, "sampling": SAMPLING,
                       "samples_per_prompt": settings.samples,
                       **{who: {mode: repetition_rate(outputs[mode]) for mode in ("greedy", "sampled")}
                          for who, outputs in (("teacher", teacher), ("student", student))}},
        # each prompt with its greedy answers and its first sampled ones (the sampled lists hold every prompt
        # once before any prompt twice, so zip pairs them)
        "answers": [{"prompt": prompt, "teacher": t, "student": s, "teacher_sampled": ts, "student_sampled": ss}
                    for prompt, t, s, ts, ss in zip(inputs.chat_prompts, teacher["greedy"], student["greedy"],
                                                    teacher["sampled"], student["sampled"])],
    }


def measure_agreement(student, teacher, tokenizer, inputs: AgreementInputs, settings: AgreementSettings,
                      dataset: str) -> dict:
    """Every agreement measure of `student` against `teacher` (both loaded, one tokenizer) on `inputs`
    (`agreement_inputs` of the source named `dataset`)."""
    teacher_outputs = model_outputs(teacher, tokenizer, inputs, settings, "teacher")
    student_outputs = model_outputs(student, tokenizer, inputs, settings, "student")
    return compare_outputs(student_outputs, teacher_outputs, inputs, settings, dataset)


# ----------------------------------------------------------------------------------------------- report


def _cell(text: str) -> str:
    """`text` as one markdown table cell: pipes escaped, line breaks as <br>, nothing as "(empty)"."""
    text = text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>").strip()
    return text or "(empty)"


def _copy_lines(copy: dict | None, student: str, teacher: str) -> list[str]:
    """The copy-accuracy table of `agreement_markdown` (nothing for a record written before it was measured)."""
    if not copy:
        return []
    return ["", f"In-context copying: top-1 accuracy on the second reading of a passage read twice ({copy['passages']} "
                f"passages of {copy['tokens']} tokens):", "",
            f"| {teacher} | {student} |", "|---:|---:|", f"| {copy['teacher']:.1%} | {copy['student']:.1%} |"]


def agreement_markdown(agreement: dict, student: str = "student", teacher: str = "teacher", level: int = 2) -> str:
    """The agreement record as markdown: measures, repetition rates, and the greedy answers side by side."""
    head, sub = "#" * level, "#" * (level + 1)
    cont, rep = agreement["continuation"], agreement["repetition"]
    sampling = ", ".join(f"{k} {v}" for k, v in rep["sampling"].items() if v)  # top_k 0 is no top-k
    if rep.get("samples_per_prompt", 1) > 1:  # records from before several samples hold one per prompt
        sampling += f"; {rep['samples_per_prompt']} sampled answers per prompt"
    lines = [
        f"{head} Agreement with the teacher", "",
        f"`{student}` against `{teacher}` on `{agreement['dataset']}`.", "",
        "| measure | value |", "|---|---:|",
        f"| teacher-forced top-1 agreement ({agreement['positions']:,} positions) "
        f"| {agreement['top1_agreement']:.1%} |",
        f"| greedy continuation: mean matching prefix ({cont['prompts']} prompts of {cont['prompt_tokens']} tokens) "
        f"| {cont['mean_matching_prefix']:.2f} of {cont['new_tokens']} tokens |",
        f"| greedy continuations identical to the teacher's | {cont['full_match']:.1%} |", "",
        f"Repetition rate: share of an answer's word {rep['ngram']}-grams that repeat an earlier one, mean over "
        f"{len(agreement['answers'])} fixed chat prompts (at most {rep['answer_tokens']} new tokens; sampled with "
        f"{sampling}):", "",
        f"| answers | {teacher} | {student} |", "|---|---:|---:|",
        *(f"| {mode} | {rep['teacher'][mode]:.1%} | {rep['student'][mode]:.1%} |" for mode in ("greedy", "sampled")),
        *_copy_lines(agreement.get("copy"), student, teacher),
        "", f"{sub} Greedy answers to the fixed prompts", "",
        f"| prompt | {teacher} | {student} |", "|---|---|---|",
        *(f"| {_cell(a['prompt'])} | {_cell(a['teacher'])} | {_cell(a['student'])} |" for a in agreement["answers"]),
    ]
    return "\n".join(lines)


__all__ = [
    "CHAT_PROMPTS",
    "DEFAULT_AGREEMENT_DATASET",
    "REPETITION_NGRAM",
    "AgreementInputs",
    "AgreementSettings",
    "agreement_inputs",
    "agreement_markdown",
    "answer_prompts",
    "chat_prompt_ids",
    "compare_outputs",
    "continuation_agreement",
    "copy_accuracy",
    "greedy_continuations",
    "matching_prefix_lengths",
    "measure_agreement",
    "model_outputs",
    "repetition_of_answer",
    "repeated_passages",
    "repetition_rate",
    "top1_agreement",
    "top1_predictions",
]
