"""Quote data: chat turns that copy from their context, made from plain text with no generation.

A converted model reads its context through a few softmax layers and fixed-size delta states, and distillation
on running text barely asks it to copy a span it has seen: after stages 1 and 2 a student asked to "repeat the
passage above" talks about the passage instead (the teacher copies it), and teacher-forced on the passage as the
answer it predicts only 55-80% of its tokens (the teacher 95%). `quote:SOURCE` (for example `quote:builtin:train`)
is a `--dataset` source of conversations whose user turn holds a passage of SOURCE text and asks for it, or a
sentence of it, back (`QUOTE_REQUESTS`), and whose assistant turn is that text exactly. Stage 2 trains on the
teacher's logits over the answer tokens (completion-only labels, as for `generated:` chat), so the student learns
the teacher's copying where the teacher copies, without the teacher generating anything.

Passages are drawn like generate-data's grounded passages (`generated.passage_span`: 60-180 words from a sentence
start to a sentence end) but keep the text's own line breaks and spacing. Conversation i is drawn by its own seed
(`generated.sample_seed(seed, "quote", i)`) and asks request i in turn, so the data is a function of the source
and `--seed` only. Evaluation splits are refused as sources (`text.check_trainable`).
"""

from __future__ import annotations

import re

from .generated import PASSAGE, passage_documents, passage_span, sample_seed

QUOTE_PREFIX = "quote:"
#: conversations a `quote:` source holds (more than any stage-2 budget reads at a quarter share)
QUOTE_CONVERSATIONS = 1024
#: (request with `{passage}`, what the answer copies): "passage", "first" / "first two" / "last" sentence(s)
QUOTE_REQUESTS = (
    ("{passage}\n\nRepeat the passage above word for word.", "passage"),
    ("Here is a passage:\n\n{passage}\n\nWrite it out again exactly, without changing a word.", "passage"),
    ("Copy this text exactly:\n\n{passage}", "passage"),
    ("{passage}\n\nCopy the first two sentences of the passage above exactly as they are written.", "first two"),
    ("{passage}\n\nQuote the first sentence of the passage above.", "first"),
    ("{passage}\n\nQuote the last sentence of the passage above.", "last"),
)
#: a break between sentences of a passage: the whitespace after a word ending in . ! or ?
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")


def quote_source(source: str) -> str:
    """The text source of a `quote:SOURCE` dataset source."""
    inner = source[len(QUOTE_PREFIX):].strip()
    if not inner:
        raise ValueError(f"--dataset {source!r}: name the text to quote after quote:, for example quote:builtin:train")
    return inner


def quote_passage(texts: list[str], sample_seed_value: int) -> str:
    """The passage that a quote conversation copies from: the words `passage_span` draws, with the spacing and line
    breaks of the text between them."""
    document, start, end = passage_span(texts, sample_seed_value)
    words = [match.span() for match in re.finditer(r"\S+", texts[document])]
    return texts[document][words[start][0]: words[end - 1][1]]


def quote_answer(passage: str, copies: str) -> str:
    """The exact text a request of kind `copies` (see `QUOTE_REQUESTS`) asks for: sentences end after a word ending
    in . ! or ? (the rule `passage_span` cuts by); a passage of fewer sentences is copied whole."""
    breaks = list(_SENTENCE_BREAK.finditer(passage))  # the whitespace after each sentence but the last
    if copies == "passage":
        return passage
    if copies in ("first", "first two"):
        count = 1 if copies == "first" else 2
        return passage[: breaks[count - 1].start()] if len(breaks) >= count else passage
    if copies == "last":
        return passage[breaks[-1].end():] if breaks else passage
    raise ValueError(f"unknown quote request kind {copies!r}")


def quote_conversation(texts: list[str], sample_seed_value: int, request: int) -> list[dict]:
    """One conversation: request `QUOTE_REQUESTS[request]` about the passage drawn by the seed, and its exact
    answer."""
    passage = quote_passage(texts, sample_seed_value)
    template, copies = QUOTE_REQUESTS[request]
    return [{"role": "user", "content": template.replace(PASSAGE, passage)},
            {"role": "assistant", "content": quote_answer(passage, copies)}]


def quote_conversations(source: str, seed: int, count: int = QUOTE_CONVERSATIONS) -> list[list[dict]]:
    """The conversations of a `quote:SOURCE` dataset source: `count` of them, the i-th asking request i modulo the
    number of requests about a passage drawn by `sample_seed(seed, "quote", i)` from the texts of SOURCE of at least
    60 words."""
    from .text import check_trainable

    inner = quote_source(source)
    check_trainable(inner)
    texts = passage_documents(inner, named=f"--dataset {source}", fix="quote longer texts")
    return [quote_conversation(texts, sample_seed(seed, "quote", index), index % len(QUOTE_REQUESTS))
            for index in range(count)]


__all__ = [
    "QUOTE_CONVERSATIONS",
    "QUOTE_PREFIX",
    "QUOTE_REQUESTS",
    "quote_answer",
    "quote_conversation",
    "quote_conversations",
    "quote_passage",
    "quote_source",
]
