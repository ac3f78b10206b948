"""Quote data (`quote:SOURCE`): chat turns whose answer copies text of the user turn exactly, drawn by the seed,
from training text only, with completion-only labels in a mix."""

import pytest

from conftest import tiny_tokenizer
from delta_attention.conversion.data.chat import IGNORE_INDEX
from delta_attention.conversion.data.generated import grounded_passage, mixed_rows, sample_seed
from delta_attention.conversion.data.quotes import (
    QUOTE_REQUESTS,
    quote_answer,
    quote_conversations,
    quote_passage,
)
from delta_attention.conversion.data.text import DataOptions

SENTENCES = ["w1 w2 w3.", "w4 w5!", "w6 w7 w8 w9?", "w10."]


def document(number: int, sentences: int = 40) -> str:
    """A text of `sentences` short sentences, broken into lines of three with double spaces here and there."""
    words = [f"w{(number * 7 + i) % 80} w{(number + i) % 80}{'.!?'[i % 3]}" for i in range(sentences)]
    lines = ["  ".join(words[i:i + 3]) for i in range(0, sentences, 3)]
    return "\n".join(lines)


@pytest.fixture()
def texts_file(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n\n".join(document(n) for n in range(5)) + "\n")
    return path


def test_a_quote_passage_keeps_the_texts_spacing_and_has_the_grounded_passages_words():
    texts = [document(n) for n in range(5)]
    for index in range(30):
        seed = sample_seed(0, "quote", index)
        passage = quote_passage(texts, seed)
        assert any(passage in text for text in texts)  # a span of one text, line breaks and spaces as written
        assert passage.split() == grounded_passage(texts, seed).split()
        assert passage.endswith((".", "!", "?")) and passage == passage.strip()
    assert any("\n" in quote_passage(texts, sample_seed(0, "quote", i)) for i in range(30))


@pytest.mark.parametrize("copies, answer", [
    ("passage", " ".join(SENTENCES[:2]) + "\n" + "  ".join(SENTENCES[2:])),
    ("first", "w1 w2 w3."),
    ("first two", "w1 w2 w3. w4 w5!"),
    ("last", "w10."),
])
def test_the_answer_is_the_asked_part_of_the_passage_exactly(copies, answer):
    passage = " ".join(SENTENCES[:2]) + "\n" + "  ".join(SENTENCES[2:])
    assert quote_answer(passage, copies) == answer


def test_a_passage_of_one_sentence_is_copied_whole_whatever_is_asked():
    for copies in ("passage", "first", "first two", "last"):
        assert quote_answer("w1 w2 w3.", copies) == "w1 w2 w3."
    with pytest.raises(ValueError, match="unknown quote request kind 'middle'"):
        quote_answer("w1.", "middle")


def test_conversations_are_drawn_by_the_seed_and_ask_each_request_in_turn(texts_file):
    source = f"quote:{texts_file}"
    conversations = quote_conversations(source, seed=0, count=12)
    assert conversations == quote_conversations(source, seed=0, count=12)
    assert conversations != quote_conversations(source, seed=1, count=12)
    for index, (user, assistant) in enumerate(conversations):
        template, _ = QUOTE_REQUESTS[index % len(QUOTE_REQUESTS)]
        before, after = template.split("{passage}")
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert user["content"].startswith(before) and user["content"].endswith(after)
        passage = user["content"][len(before): len(user["content"]) - len(after)]
        assert assistant["content"] in passage and assistant["content"].strip() == assistant["content"]


def test_in_a_mix_the_labels_cover_exactly_the_copied_answers(texts_file):
    tokenizer = tiny_tokenizer()
    source = f"quote:{texts_file}"
    rows = mixed_rows(DataOptions(dataset=source, seq_len=4096, packing="plain"), tokenizer)
    conversations = quote_conversations(source, seed=0)
    assert rows["input_ids"].shape[0] == len(conversations)
    for ids, labels, (_, assistant) in list(zip(rows["input_ids"], rows["labels"], conversations))[:20]:
        learned = ids[labels != IGNORE_INDEX].tolist()
        assert learned == tokenizer(assistant["content"])["input_ids"] + [tokenizer.eos_token_id]
    packed = mixed_rows(DataOptions(dataset=f"{source}@1+{texts_file}@1", seq_len=256), tokenizer)
    assert {"input_ids", "labels", "position_ids"} == set(packed)
    assert (packed["labels"] == IGNORE_INDEX).any() and (packed["labels"] != IGNORE_INDEX).any()


@pytest.mark.parametrize("dataset, message", [
    ("quote:builtin:heldout", r"builtin:heldout is the evaluation split \(never trained on\)"),
    ("builtin:train@1+quote:builtin:crossdomain@1", r"builtin:crossdomain is the evaluation split"),
    ("quote:", r"name the text to quote after quote:, for example quote:builtin:train"),
])
def test_a_quote_source_of_evaluation_text_or_of_nothing_is_refused(dataset, message):
    with pytest.raises(ValueError, match=message):
        DataOptions(dataset=dataset).validate()


def test_text_too_short_to_quote_is_refused(tmp_path):
    (tmp_path / "short.txt").write_text("w1 w2 w3.\n")
    with pytest.raises(ValueError, match=r"no text of at least 60 words to quote"):
        quote_conversations(f"quote:{tmp_path / 'short.txt'}", seed=0)
