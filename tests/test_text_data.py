"""Text data through `datasets`: local txt/jsonl/parquet, packing into blocks, deterministic shuffling, errors."""

import json

import pytest
import torch

from conftest import tiny_tokenizer
from delta_attention.conversion.data.text import DataOptions, load_texts, pack_blocks, training_blocks

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
    options = DataOptions(dataset=str(corpus / "docs.jsonl"), text_column="body", seq_len=8, packing="plain")
    blocks = training_blocks(options, tokenizer)
    stream = expected_stream(tokenizer)
    assert isinstance(blocks, torch.Tensor) and blocks.dtype == torch.long
    assert blocks.shape == (len(stream) // 8, 8)
    assert blocks.flatten().tolist() == stream[: blocks.numel()]


def expected_positions(ids: list[int], eos: int) -> list[int]:
    """Positions counted by hand: 0 at the block start and right after each EOS, else one more than before."""
    positions = []
    for t, token in enumerate(ids):
        positions.append(0 if t == 0 or ids[t - 1] == eos else positions[-1] + 1)
    return positions


def test_boundary_packing_restarts_position_ids_after_each_eos(corpus, tokenizer):
    options = DataOptions(dataset=str(corpus / "docs.jsonl"), text_column="body", seq_len=16)
    assert options.packing == "boundary"  # the default
    with pytest.raises(ValueError, match="--packing must be one of boundary, plain, got 'docs'"):
        DataOptions(packing="docs").validate()
    blocks = training_blocks(options, tokenizer)
    plain = training_blocks(DataOptions(**{**options.__dict__, "packing": "plain"}), tokenizer)
    assert set(blocks) == {"input_ids", "position_ids"} and torch.equal(blocks["input_ids"], plain)
    eos = tokenizer.eos_token_id
    assert int((blocks["input_ids"] == eos).sum()) >= 4  # several documents end inside blocks
    for ids, positions in zip(blocks["input_ids"].tolist(), blocks["position_ids"].tolist()):
        assert positions == expected_positions(ids, eos)
    # documents cut by a block boundary start the next block at 0, and none is longer than its own tokens
    assert blocks["position_ids"][:, 0].eq(0).all()
    lengths = [len(tokenizer(t)["input_ids"]) for t in DOCS]
    assert int(blocks["position_ids"].max()) <= max(lengths)


def test_boundary_packing_streams_the_same_position_ids_and_resumes_exactly(corpus, tokenizer):
    from delta_attention.conversion.training.loop import _micro_batches

    options = DataOptions(dataset=str(corpus / "docs.parquet"), seq_len=8, streaming=True, shuffle_buffer=4, seed=1)
    rows = list(training_blocks(options, tokenizer))
    for row in rows:
        assert row["position_ids"] == expected_positions(row["input_ids"], tokenizer.eos_token_id)
    loaded = training_blocks(DataOptions(dataset=str(corpus / "docs.parquet"), seq_len=8), tokenizer)
    for blocks in (training_blocks(options, tokenizer), loaded):  # streamed and loaded: resuming at block 6
        straight = _micro_batches(blocks, 2, seed=3, start_block=0)
        batches = [next(straight) for _ in range(5)]
        resumed = _micro_batches(blocks, 2, seed=3, start_block=6)
        for expected in batches[3:]:
            got = next(resumed)
            assert set(got) == {"input_ids", "position_ids"}
            assert all(torch.equal(got[key], expected[key]) for key in got)


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


# --- bad input: one clear error naming the problem and the fix ---------------------------------------------


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, also in the constants `datasets` read when it was imported."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


@pytest.mark.parametrize("streaming", [False, True])
def test_an_unreachable_hub_dataset_says_offline_and_the_fix(offline, streaming):
    with pytest.raises(FileNotFoundError) as raised:
        load_texts("someone/some-dataset", streaming=streaming)
    message = str(raised.value)
    assert "\n" not in message
    assert "someone/some-dataset" in message and "could not be reached" in message
    assert "may be offline (HF_HUB_OFFLINE is set)" in message
    assert "a local .txt/.jsonl/.parquet file or folder, or builtin:train" in message


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("lines, problem", [
    (['{"text": "a"}', "", '{"text": "b"', '{"text": "c"}'], r"line 3 is not valid JSON \(column 13: Expecting ','"),
    (['{"text": "a"}', "[1, 2]"], r"line 2 is JSON but not an object \(got list\)"),
    (['{"text": "a"}', '"just a string"'], r"line 2 is JSON but not an object \(got str\)"),
])
def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path, lines, problem, streaming):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a_good.jsonl").write_text('{"text": "fine"}\n')
    (folder / "b_bad.jsonl").write_text("\n".join(lines) + "\n")
    for source in (folder, folder / "b_bad.jsonl"):
        with pytest.raises(ValueError, match=r"b_bad\.jsonl: " + problem):
            load_texts(str(source), streaming=streaming)


def test_a_malformed_json_or_corrupt_parquet_file_is_named(tmp_path):
    (tmp_path / "bad.json").write_text('[\n  {"text": "a"},\n  {"text": "b" "c"}\n]\n')
    with pytest.raises(ValueError, match=r"bad\.json: not valid JSON \(line 3, column 16: Expecting ','"):
        load_texts(str(tmp_path / "bad.json"))
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"lines\.json: line 3 is not valid JSON"):
        load_texts(str(tmp_path / "lines.json"))
    folder = tmp_path / "parquet"
    folder.mkdir()
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(folder / "a_good.parquet"))
    (folder / "b_broken.parquet").write_bytes(b"PAR1 not really parquet")
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"b_broken\.parquet: not a readable Parquet file"):
            load_texts(str(folder), streaming=streaming)


def test_empty_jsonl_files_say_there_are_no_rows(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no rows \(every \.jsonl file is empty\)"):
        load_texts(str(tmp_path / "empty.jsonl"))


def test_a_missing_column_names_the_flag_the_caller_gives(corpus):
    with pytest.raises(ValueError, match=r"no column 'messages' \(columns: \['body'\]\); pass --messages_column"):
        load_texts(str(corpus / "docs.jsonl"), text_column="messages", column_flag="--messages_column")
    with pytest.raises(ValueError, match=r"no column 'messages' \(columns: \['body'\]\); pass --text_column"):
        load_texts(str(corpus / "docs.jsonl"), text_column="messages")


def test_rows_that_are_not_text_are_named(tmp_path, tokenizer):
    (tmp_path / "docs.jsonl").write_text('{"text": "w1 w2"}\n{"text": null}\n{"text": "w3"}\n')
    with pytest.raises(ValueError, match=r"row 1 \(counted from 0\) holds a NoneType, not text.*pass --text_column"):
        pack_blocks(load_texts(str(tmp_path / "docs.jsonl")), tokenizer, 4)


def test_streamed_txt_files_have_their_text_column(corpus, tokenizer):
    texts = load_texts(str(corpus / "txt"), streaming=True)
    assert sorted(row["text"] for row in texts) == sorted(DOCS)
    options = DataOptions(dataset=str(corpus / "txt"), seq_len=8, streaming=True, shuffle_buffer=4)
    assert all(len(row["input_ids"]) == 8 for row in training_blocks(options, tokenizer))


@pytest.mark.parametrize("fields, problem", [
    ({"seq_len": 1}, r"--seq_len must be at least 2.*got 1"),
    ({"seq_len": 0}, r"--seq_len must be at least 2.*got 0"),
    ({"shuffle_buffer": 0, "streaming": True}, r"--shuffle_buffer must be at least 1.*got 0"),
    ({"dataset": " "}, r"--dataset is empty; give builtin:train"),
])
def test_options_are_validated_before_any_data_is_read(tokenizer, fields, problem):
    options = DataOptions(**fields)
    with pytest.raises(ValueError, match=problem):
        options.validate()
    with pytest.raises(ValueError, match=problem):
        training_blocks(options, tokenizer)
    assert DataOptions().validate() == DataOptions()


def test_a_seq_len_past_the_models_positions_warns_once(capsys):
    from conftest import tiny_delta_config

    from delta_attention.conversion.data.text import warn_if_longer_than_model

    config = tiny_delta_config(max_position_embeddings=64)
    assert warn_if_longer_than_model(128, config) is True
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: --seq_len 128")
    assert "max_position_embeddings (64)" in err and "--seq_len 64 or less" in err
    assert warn_if_longer_than_model(64, config) is False
    assert warn_if_longer_than_model(8, {"max_position_embeddings": 4}) is True
    assert warn_if_longer_than_model(10**6, object()) is False
    assert capsys.readouterr().err.count("\n") == 1


def test_files_that_datasets_cannot_read_are_named(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("w1 w2\ncaf\xe9 w3\n".encode("latin-1"))
    for streaming in (False, True):
        with pytest.raises(ValueError, match=r"latin1\.txt: line 2 is not UTF-8 text .*save the file as UTF-8"):
            load_texts(str(tmp_path / "latin1.txt"), streaming=streaming)
    (tmp_path / "number.json").write_text("5\n")
    with pytest.raises(ValueError, match=r"number\.json: the JSON document must be a list of objects .*not int"):
        load_texts(str(tmp_path / "number.json"))
    # a Parquet file whose footer reads but whose pages do not: the error still names the file
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(tmp_path / "pages.parquet"))
    data = bytearray((tmp_path / "pages.parquet").read_bytes())
    data[8:60] = bytes(b ^ 0x5A for b in data[8:60])
    (tmp_path / "pages.parquet").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"pages\.parquet: could not be read as parquet data \("):
        load_texts(str(tmp_path / "pages.parquet"))
