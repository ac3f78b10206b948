"""Chat conversations to rows: bad conversations give one clear error naming the row and what is wrong."""

import json

import pytest
import torch

from conftest import tiny_tokenizer
from delta_attention.conversion.data.chat import IGNORE_INDEX, chat_rows, conversation_tokens, packed_chat_rows
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


def _pieces(rows):
    """Each row of `packed_chat_rows` split where its position ids restart: `(ids, labels)` lists in order."""
    pieces = []
    for ids, labels, positions in zip(*(rows[key].tolist() for key in ("input_ids", "labels", "position_ids"))):
        starts = [i for i, position in enumerate(positions) if position == 0] + [len(positions)]
        pieces += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
    return pieces


def test_packed_rows_hold_whole_conversations_in_order_with_positions_from_zero(tokenizer):
    conversations = [good(i) for i in range(5)]
    alone = [conversation_tokens(tokenizer, c) for c in conversations]
    length = len(alone[0][0])
    assert all(len(ids) == length for ids, _ in alone)
    rows = packed_chat_rows(tokenizer, conversations, seq_len=2 * length + 1)  # two conversations fit a row
    assert rows["input_ids"].shape == rows["labels"].shape == rows["position_ids"].shape == (3, 2 * length + 1)
    pieces = _pieces(rows)
    assert [p for p in pieces if any(label != IGNORE_INDEX for label in p[1])] == alone
    padding = [p for p in pieces if all(label == IGNORE_INDEX for label in p[1])]
    assert [len(ids) for ids, _ in padding] == [1, 1, length + 1]  # one pad after each full row, the last row's rest
    assert all(set(ids) == {tokenizer.pad_token_id} for ids, _ in padding)


def test_a_conversation_longer_than_a_row_is_cut_and_has_a_row_alone(tokenizer):
    long = [{"role": "user", "content": "w1"}, {"role": "assistant", "content": " ".join(f"w{i}" for i in range(30))}]
    rows = packed_chat_rows(tokenizer, [good(0), long, good(1)], seq_len=12)
    pieces = _pieces(rows)
    assert len(rows["input_ids"]) == 3 and pieces[2] == tuple(x[:12] for x in conversation_tokens(tokenizer, long))
    assert rows["position_ids"][1].tolist() == list(range(12))


def test_a_packed_row_gives_each_conversation_the_logits_it_has_alone(tokenizer):
    # the delta layers reset their state and conv window, the softmax layers mask, at each restart of the positions
    # (transformers reads packed position ids only without a cache, as distillation runs its teacher and student)
    from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_llama_teacher

    conversations = [good(0), [{"role": "user", "content": "w5 w6 w7"}, {"role": "assistant", "content": "w8 w9"}],
                     good(3)]
    rows = packed_chat_rows(tokenizer, conversations, seq_len=32)
    assert len(rows["input_ids"]) == 1
    for model in (tiny_delta_model(seed=4, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6),
                  tiny_llama_teacher().eval()):
        with torch.no_grad():
            packed = model(input_ids=rows["input_ids"], position_ids=rows["position_ids"], use_cache=False).logits[0]
            start = 0
            for messages in conversations:
                ids = torch.tensor([conversation_tokens(tokenizer, messages)[0]])
                alone = model(input_ids=ids).logits[0]
                torch.testing.assert_close(packed[start : start + ids.shape[1]], alone, atol=1e-5, rtol=1e-4)
                start += ids.shape[1]
