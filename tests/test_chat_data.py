"""Chat conversations to rows: bad conversations give one clear error naming the row and what is wrong."""

import json

import pytest

from conftest import tiny_tokenizer
from delta_attention.conversion.data.chat import IGNORE_INDEX, chat_rows
from delta_attention.conversion.data.text import load_texts


def good(seed=0):
    return [{"role": "user", "content": f"w{seed} w{seed + 1}"}, {"role": "assistant", "content": f"w{seed + 40}"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def test_good_conversations_make_rows_with_completion_labels(tokenizer):
    rows = chat_rows(tokenizer, [good(0), good(1)], seq_len=12)
    assert rows["input_ids"].shape == rows["labels"].shape == rows["attention_mask"].shape == (2, 12)
    kept = [i for i, label in zip(rows["input_ids"][0].tolist(), rows["labels"][0].tolist()) if label != IGNORE_INDEX]
    assert tokenizer.decode(kept).split() == ["w40", "<eos>"]


def test_a_message_without_a_role_in_a_jsonl_file_is_named_by_row(tmp_path, tokenizer):
    # datasets fills a key missing from one message with None, so the row reaches chat_rows as role=None
    rows = [good(0), [{"content": "w1"}, {"role": "assistant", "content": "w2"}], good(2)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    table = load_texts(str(tmp_path / "chat.jsonl"), text_column="messages", column_flag="--messages_column")
    with pytest.raises(ValueError, match=r"chat row 1 \(counted from 0\), message 0: no 'role'; each message needs"):
        chat_rows(tokenizer, (row["text"] for row in table), seq_len=16)


@pytest.mark.parametrize("bad, problem", [
    ([{"role": "user"}, {"role": "assistant", "content": "w2"}], r"message 0 \(user\): no 'content'"),
    ([{"role": "user", "content": "w1"}, {"role": "assistant", "content": None}],
     r"message 1 \(assistant\): no 'content'"),
    ([{"role": 1, "content": "w1"}, {"role": "assistant", "content": "w2"}],
     r"message 0: 'role' must be a string, got int 1;"),
    ("user: w1 assistant: w2",
     r"messages must be a list of \{'role', 'content'\} dicts, got str; pass --messages_column"),
    (["w1", "w2"], r"message 0: expected a \{'role', 'content'\} dict, got str"),
])
def test_bad_conversations_name_the_row_and_the_problem(tokenizer, bad, problem):
    with pytest.raises(ValueError, match=r"chat row 2 \(counted from 0\).*" + problem):
        chat_rows(tokenizer, [good(0), good(1), bad], seq_len=16)


def test_a_template_that_rejects_a_conversation_names_the_row(tokenizer):
    strict = tiny_tokenizer()
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn must be the "
                            "user') }}{% endif %}" + strict.chat_template)
    reversed_turns = good(1)[::-1]
    with pytest.raises(ValueError, match=r"chat row 1 \(counted from 0\): the tokenizer's chat template rejected it "
                                         r"\(the first turn must be the user\)"):
        chat_rows(strict, [good(0), reversed_turns], seq_len=16)


def test_a_seq_len_below_two_is_refused(tokenizer):
    with pytest.raises(ValueError, match="--seq_len must be at least 2, got 1"):
        chat_rows(tokenizer, [good(0)], seq_len=1)
