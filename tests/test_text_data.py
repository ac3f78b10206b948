"""Text data through `datasets`: local txt/jsonl/parquet, packing into blocks, deterministic shuffling, errors."""

import json

import pytest
import torch

from conftest import tiny_tokenizer
from delta_attention.conversion.text_data import DataOptions, load_texts, pack_blocks, training_blocks

DOCS = [" ".join(f"w{(d * 7 + i) % 50}" for i in range(40 + 10 * d)) for d in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "txt"
    folder.mkdir()
    for d, text in enumerate(DOCS):
        (folder / f"doc{d}.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in DOCS))
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "docs.parquet"))
    return tmp_path


def expected_stream(tokenizer):
    stream = []
    for text in DOCS:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return stream


@pytest.mark.parametrize("source, column", [("txt", "text"), ("docs.jsonl", "body"), ("docs.parquet", "text")])
def test_local_files_pack_into_the_expected_blocks(corpus, tokenizer, source, column):
    texts = load_texts(str(corpus / source), text_column=column)
    assert sorted(texts["text"]) == sorted(DOCS)
    blocks = pack_blocks(texts.sort("text") if source == "txt" else texts, tokenizer, seq_len=16)
    stream = expected_stream(tokenizer) if source != "txt" else None
    assert all(len(b) == 16 for b in blocks["input_ids"])
    assert len(blocks) == sum(len(tokenizer(t)["input_ids"]) + 1 for t in DOCS) // 16
    if stream is not None:
        assert blocks["input_ids"][:3] == [stream[0:16], stream[16:32], stream[32:48]]


def test_training_blocks_are_a_tensor_of_the_packed_stream(corpus, tokenizer):
    options = DataOptions(dataset=str(corpus / "docs.jsonl"), text_column="body", seq_len=8)
    blocks = training_blocks(options, tokenizer)
    stream = expected_stream(tokenizer)
    assert isinstance(blocks, torch.Tensor) and blocks.dtype == torch.long
    assert blocks.shape == (len(stream) // 8, 8)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]


def test_streaming_gives_the_same_blocks(corpus, tokenizer):
    options = DataOptions(dataset=str(corpus / "docs.parquet"), seq_len=8, streaming=True, shuffle_buffer=4, seed=1)
    streamed = [row["input_ids"] for row in training_blocks(options, tokenizer)]
    again = [row["input_ids"] for row in training_blocks(options, tokenizer)]
    loaded = pack_blocks(load_texts(str(corpus / "docs.parquet")), tokenizer, 8)["input_ids"]
    assert streamed == again  # the buffer shuffle is seeded
    assert streamed != list(loaded) and sorted(map(tuple, streamed)) == sorted(map(tuple, loaded))


def test_errors_name_the_problem(corpus, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"no column 'text' \(columns: \['body'\]\); pass --text_column"):
        load_texts(str(corpus / "docs.jsonl"))
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_texts(str(tmp_path / "missing.txt"))
    (tmp_path / "weird.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"expected \.txt, \.jsonl/\.json or \.parquet files"):
        load_texts(str(tmp_path / "weird.csv"))
    with pytest.raises(ValueError, match="builtin:heldout is the evaluation split"):
        training_blocks(DataOptions(dataset="builtin:heldout"), tokenizer)
    with pytest.raises(ValueError, match="not enough text for one block of 100000 tokens"):
        training_blocks(DataOptions(dataset=str(corpus / "docs.parquet"), seq_len=100_000), tokenizer)
