"""Teacher-generated data (`generate-data`, `generated:OUT`): reproducible from its seed whatever the batching,
resumable after a kill, chat prompts through the chat template with labels on exactly the answer tokens, the
masked stage-2 KL, weighted mixes, and `distill` training on it. Tiny random Llama teacher, word-level tokenizer."""

import json
from pathlib import Path

import pyarrow.parquet
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import delta_attention.conversion.data.generated as generated
from conftest import tiny_tokenizer
from delta_attention.conversion.data.chat import IGNORE_INDEX
from delta_attention.conversion.data.generated import (
    GenerateOptions,
    SeededSampling,
    generate_batch,
    generate_data,
    load_prompts,
    mixed_rows,
    prompt_ids,
    sample_seed,
)
from delta_attention.conversion.data.text import DataOptions, training_blocks
from delta_attention.scripts.cli import main as cli


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)).eval()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A tiny teacher folder (random Llama + word-level tokenizer with a chat template) and a prompt file of
    prompts of different lengths (so batches are left-padded)."""
    root = tmp_path_factory.mktemp("generated")
    tiny_llama().save_pretrained(root / "teacher")
    tiny_tokenizer().save_pretrained(root / "teacher")
    chat = ["w1", "w2 w3 w4", "w5 w6", "w7 w8 w9 w10 w11", "w12 w13 w14"]
    text = ["w20 w21", "w22", "w23 w24 w25 w26"]
    lines = [{"kind": "chat", "category": "test", "prompt": p} for p in chat]
    lines += [{"kind": "text", "category": "opening", "prompt": p} for p in text]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def options(root, out, **overrides):
    fields = dict(teacher=str(root / "teacher"), output_dir=str(out), kind="both", num_samples=7, shard_size=3,
                  max_new_tokens=10, temperature=1.0, top_p=0.9, batch_size=4, prompts=str(root / "prompts.jsonl"))
    return GenerateOptions(**{**fields, **overrides})


def rows(folder) -> dict[str, list[dict]]:
    """Every sample of a generate-data folder by kind, in index order (duplicates kept, to be seen)."""
    return {kind: sorted((row for path in sorted((Path(folder) / kind).glob("shard-*.parquet"))
                          for row in pyarrow.parquet.read_table(path).to_pylist()), key=lambda row: row["index"])
            for kind in ("chat", "text")}


def test_the_built_in_prompt_set_is_a_few_hundred_varied_prompts():
    prompts = load_prompts()
    chat = [p for p in prompts if p["kind"] == "chat"]
    assert len(chat) >= 300 and len({p["prompt"] for p in chat}) == len(chat)
    assert {"list", "explanation", "how-to", "story", "poem", "rewriting", "question", "advice"} <= {
        p["category"] for p in chat}
    assert len([p for p in prompts if p["kind"] == "text"]) >= 40
    # the first few samples of a seed already span several kinds of request
    order = generated.prompt_order(len(chat), 0, 16)
    assert len({chat[i]["category"] for i in order}) >= 5 and len(set(order)) == 16


def test_batched_generation_matches_a_plain_per_token_loop(root):
    """Left padding, the cache and the seeded draw: each row of a batch gets the tokens that running its prompt alone,
    one full forward per token, with the same seed gives."""
    model, tokenizer = tiny_llama(), tiny_tokenizer()
    prompts = [prompt_ids(tokenizer, "chat", p) for p in ("w1", "w7 w8 w9 w10 w11", "w5 w6")]
    seeds = [sample_seed(0, "chat", i) for i in range(3)]
    batched = generate_batch(model, tokenizer, prompts, seeds, max_new_tokens=12, temperature=1.0, top_p=0.9)
    for ids, seed, (new_ids, finished) in zip(prompts, seeds, batched):
        sampler, tokens, expected, ended = SeededSampling([torch.Generator().manual_seed(seed)], 1.0, 0.9), list(ids), [], False
        with torch.no_grad():
            for _ in range(12):
                scores = sampler(torch.tensor([tokens]), model(torch.tensor([tokens])).logits[:, -1])
                token = int(scores.argmax())
                if token == tokenizer.eos_token_id:
                    ended = True
                    break
                tokens.append(token)
                expected.append(token)
        assert (new_ids, finished) == (expected, ended)
    assert sum(len(new_ids) for new_ids, _ in batched) > 6  # the test sampled something


def test_the_same_seed_gives_the_same_samples_whatever_the_batch_size(root, tmp_path):
    one = generate_data(options(root, tmp_path / "one", batch_size=1))
    four = generate_data(options(root, tmp_path / "four", batch_size=4))
    a, b = rows(tmp_path / "one"), rows(tmp_path / "four")
    assert [r["index"] for r in a["chat"]] == [r["index"] for r in a["text"]] == list(range(7))
    assert a == b
    assert one["kinds"] == four["kinds"] == ["chat", "text"] and one["complete"] and one["last_run"]["samples"] == 14
    answers = [r["messages"][1]["content"] for r in a["chat"]]
    assert len(set(answers)) > 3 and all(r["messages"][0]["content"] == r["prompt"] for r in a["chat"])
    assert all(r["text"].startswith(r["prompt"]) for r in a["text"])
    generate_data(options(root, tmp_path / "other", seed=1))
    assert rows(tmp_path / "other")["chat"] != a["chat"]  # the seed decides the samples


def test_a_converted_student_writes_its_own_answers(root, tmp_path):
    """A delta-attention model writes too (its own answers, for stage 2 to score with the teacher's KL): the same
    samples whatever the batch size (left-padded batches through its delta cache), the prompts of the teacher's run,
    and answers of its own, not the teacher's."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert

    settings = ConversionSettings(keep_attention="none", init="copy", calibration_tokens=64, calibration_seq_len=16,
                                  chunk_size=16, bf16=False)
    convert(str(root / "teacher"), out=tmp_path / "student", settings=settings,
            calibration_texts=[" ".join(f"w{i % 90}" for i in range(200))], progress=False, log=lambda *a: None)
    one = generate_data(options(root, tmp_path / "one", teacher=str(tmp_path / "student"), kind="chat",
                                batch_size=1))
    generate_data(options(root, tmp_path / "four", teacher=str(tmp_path / "student"), kind="chat"))
    generate_data(options(root, tmp_path / "teacher", kind="chat"))
    ours, theirs = rows(tmp_path / "one")["chat"], rows(tmp_path / "teacher")["chat"]
    assert one["complete"] and len(ours) == 7 and ours == rows(tmp_path / "four")["chat"]
    assert [r["prompt"] for r in ours] == [r["prompt"] for r in theirs]  # the same prompts in the same order
    assert [r["messages"][1]["content"] for r in ours] != [r["messages"][1]["content"] for r in theirs]


def test_a_killed_run_resumes_to_the_data_of_a_straight_run(root, tmp_path, monkeypatch):
    generate_data(options(root, tmp_path / "straight"))
    written, original = [], generated._write_shard

    class Killed(Exception):
        pass

    def killed_after_two_shards(path, shard_rows):
        if len(written) == 2:
            path.with_name(f".{path.name}.partial").write_bytes(b"cut short")  # what a kill mid-write leaves
            raise Killed
        written.append(path)
        original(path, shard_rows)

    monkeypatch.setattr(generated, "_write_shard", killed_after_two_shards)
    with pytest.raises(Killed):
        generate_data(options(root, tmp_path / "resumed"))
    monkeypatch.setattr(generated, "_write_shard", original)
    assert sum(len(r) for r in rows(tmp_path / "resumed").values()) == 6  # two shards of three
    with pytest.raises(FileExistsError, match="pass --resume to continue that run or --overwrite"):
        generate_data(options(root, tmp_path / "resumed"))
    with pytest.raises(ValueError, match=r"cannot resume .*: seed was 0, now 1; resume with the same options"):
        generate_data(options(root, tmp_path / "resumed", seed=1, resume=True))
    record = generate_data(options(root, tmp_path / "resumed", batch_size=2, resume=True))
    assert record["last_run"]["samples"] == 14 - 6 and record["complete"]
    assert rows(tmp_path / "resumed") == rows(tmp_path / "straight")  # no duplicates, nothing missing
    # more samples later: only the new ones are written, the first seven stay as they were
    record = generate_data(options(root, tmp_path / "resumed", num_samples=9, resume=True))
    assert record["last_run"]["samples"] == 2 * (9 - 6)  # the short last shard (6..8) is written again, full
    longer = rows(tmp_path / "resumed")
    assert [r["index"] for r in longer["chat"]] == list(range(9))
    assert longer["chat"][:7] == rows(tmp_path / "straight")["chat"]


def test_chat_samples_use_the_chat_template_and_labels_cover_exactly_the_answers(root, tmp_path):
    tokenizer = tiny_tokenizer()
    assert tokenizer.convert_ids_to_tokens(prompt_ids(tokenizer, "chat", "w2 w3 w4")) == [
        "<user>", "w2", "w3", "w4", "<eos>", "<assistant>"]
    generate_data(options(root, tmp_path / "gen", kind="chat"))
    samples = rows(tmp_path / "gen")["chat"]
    source = f"generated:{tmp_path / 'gen'}"
    plain = mixed_rows(DataOptions(dataset=source, seq_len=48, packing="plain"), tokenizer)  # one sample a row
    assert sorted(plain) == ["input_ids", "labels"] and plain["input_ids"].shape == (7, 48)
    alone = []
    for sample, ids, labels in zip(samples, plain["input_ids"], plain["labels"]):
        prompt = prompt_ids(tokenizer, "chat", sample["prompt"])
        answer = tokenizer(sample["messages"][1]["content"])["input_ids"] + [tokenizer.eos_token_id]
        assert ids[: len(prompt)].tolist() == prompt
        assert ids[labels != IGNORE_INDEX].tolist() == answer  # exactly the answer and its end-of-turn
        assert (labels != IGNORE_INDEX).nonzero().flatten().tolist() == list(range(len(prompt), len(prompt) + len(answer)))
        alone.append((ids[: len(prompt) + len(answer)].tolist(), labels[: len(prompt) + len(answer)].tolist()))
    # boundary packing (the default): the same samples in order, several to a row, positions from 0 at each
    packed = mixed_rows(DataOptions(dataset=source, seq_len=48), tokenizer)
    assert sorted(packed) == ["input_ids", "labels", "position_ids"] and len(packed["input_ids"]) < 7
    pieces = []
    for ids, labels, positions in zip(*(packed[key].tolist() for key in ("input_ids", "labels", "position_ids"))):
        starts = [i for i, position in enumerate(positions) if position == 0] + [48]
        pieces += [(ids[a:b], labels[a:b]) for a, b in zip(starts, starts[1:])]
    assert [piece for piece in pieces if set(piece[1]) != {IGNORE_INDEX}] == alone


def test_the_masked_kl_counts_only_answer_positions():
    from delta_attention.conversion.training.objectives import LogitDistillation

    teacher, student = tiny_llama(0), tiny_llama(1)
    input_ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[0, 4:9], labels[1, 2:12] = input_ids[0, 4:9], input_ids[1, 2:12]
    loss, metrics = LogitDistillation(teacher, student, temperature=2.0, ce_weight=0.5)(input_ids, labels=labels)
    with torch.no_grad():
        p_logits, q_logits = teacher(input_ids).logits, student(input_ids).logits
    kl, ce, count = 0.0, 0.0, 0
    for b in range(2):
        for t in range(11):
            if labels[b, t + 1] == IGNORE_INDEX:
                continue
            p, q = F.softmax(p_logits[b, t] / 2.0, -1), F.softmax(q_logits[b, t] / 2.0, -1)
            kl += float((p * (p.log() - q.log())).sum()) * 4.0
            ce -= float(F.log_softmax(q_logits[b, t], -1)[labels[b, t + 1]])
            count += 1
    assert count == 5 + 10  # labels 4..8 of row 0 and 2..11 of row 1, each predicted from the position before
    assert metrics["kl"] == pytest.approx(kl / count, rel=1e-4) and metrics["ce"] == pytest.approx(ce / count, rel=1e-4)
    assert loss.item() == pytest.approx(kl / count + 0.5 * ce / count, rel=1e-4)


def test_a_weighted_mix_gives_each_source_its_share_and_drops_no_row(root, tmp_path):
    generate_data(options(root, tmp_path / "gen", kind="chat"))
    (tmp_path / "train.txt").write_text(" ".join(f"w{(i * 7) % 90}" for i in range(2000)))
    tokenizer = tiny_tokenizer()
    text = training_blocks(DataOptions(dataset=str(tmp_path / "train.txt"), seq_len=32), tokenizer)
    mix = training_blocks(DataOptions(dataset=f"{tmp_path / 'train.txt'}@1+generated:{tmp_path / 'gen'}@3",
                                      seq_len=32), tokenizer)
    chat = training_blocks(DataOptions(dataset=f"generated:{tmp_path / 'gen'}", seq_len=32), tokenizer)
    is_chat = (mix["labels"] == IGNORE_INDEX).any(dim=1)
    n_text = len(text["input_ids"])  # 62 blocks; the 7 samples' few packed chat rows at 3 times the share -> 186
    assert int((~is_chat).sum()) == n_text and int(is_chat.sum()) == 3 * n_text
    assert torch.equal(mix["labels"][~is_chat], mix["input_ids"][~is_chat])  # text rows: every token counts
    assert {tuple(row) for row in mix["input_ids"][~is_chat].tolist()} == {tuple(r) for r in text["input_ids"].tolist()}
    # each chat row, repeated
    assert {tuple(row) for row in mix["input_ids"][is_chat].tolist()} == {tuple(r) for r in chat["input_ids"].tolist()}
    with pytest.raises(ValueError, match="give a weight to every source of the mix or to none"):
        DataOptions(dataset=f"{tmp_path / 'train.txt'}@1+generated:{tmp_path / 'gen'}").validate()
    with pytest.raises(ValueError, match=r"the weight of 'builtin:train' must be a positive number after @, got 'x'"):
        DataOptions(dataset="builtin:train@x").validate()
    with pytest.raises(ValueError, match="builtin:heldout is the evaluation split"):
        DataOptions(dataset=f"builtin:heldout@1+generated:{tmp_path / 'gen'}@1").validate()


def test_distill_trains_on_generated_data_with_the_answer_only_kl(root, tmp_path, monkeypatch):
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert
    from delta_attention.conversion.training import objectives
    from delta_attention.conversion.training.distill import DistillOptions, run_distill
    from delta_attention.conversion.training.lora import LoraOptions
    from delta_attention.conversion.training.loop import TrainingOptions

    settings = ConversionSettings(keep_attention="0", init="copy", calibration_tokens=64, calibration_seq_len=16,
                                  chunk_size=16, bf16=False)
    convert(str(root / "teacher"), out=tmp_path / "student", settings=settings,
            calibration_texts=[" ".join(f"w{i % 90}" for i in range(200))], progress=False, log=lambda *a: None)
    generate_data(options(root, tmp_path / "gen", num_samples=8))
    seen, forward = [], objectives.LogitDistillation.forward

    def spy(self, input_ids, position_ids=None, labels=None):
        seen.append(labels)
        return forward(self, input_ids, position_ids, labels)

    monkeypatch.setattr(objectives.LogitDistillation, "forward", spy)
    results = run_distill(
        DistillOptions(student=str(tmp_path / "student"), output_dir=str(tmp_path / "run"), eval_tokens=0,
                       stage1_tokens=2 * 4 * 32, stage2_tokens=3 * 4 * 32),
        DataOptions(dataset=f"generated:{tmp_path / 'gen'}", seq_len=32),
        TrainingOptions(batch_size=4, mixed_precision="no"), LoraOptions(lora_r=4))
    assert results["stage1"]["tokens"] == 2 * 4 * 32 and results["stage2"]["tokens"] == 3 * 4 * 32
    assert len(seen) == 3 and all(labels is not None and labels.shape == (4, 32) for labels in seen)
    # chat rows leave the prompt and padding out; text blocks count every token
    assert any((labels == IGNORE_INDEX).any() for labels in seen)
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_bfloat16_weights_write_reproducible_samples_and_a_folder_resumes_only_in_its_dtype(root, tmp_path,
                                                                                           monkeypatch):
    dtypes, original = [], generated.generate_batch

    def recording_dtype(model, *args, **kwargs):
        dtypes.append(next(model.parameters()).dtype)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(generated, "generate_batch", recording_dtype)
    record = generate_data(options(root, tmp_path / "bf16", dtype="bfloat16"))
    assert set(dtypes) == {torch.bfloat16} and record["dtype"] == "bfloat16"
    generate_data(options(root, tmp_path / "again", dtype="bfloat16"))
    assert rows(tmp_path / "again") == rows(tmp_path / "bf16")  # the seed decides the samples in bf16 too
    dtypes.clear()
    assert generate_data(options(root, tmp_path / "fp32"))["dtype"] == "float32" and set(dtypes) == {torch.float32}
    with pytest.raises(ValueError, match=r"cannot resume .*: dtype was 'bfloat16', now 'float32'; resume with the same"):
        generate_data(options(root, tmp_path / "bf16", num_samples=9, resume=True))
    # a folder written before --dtype existed was float32: it resumes as such, and only as such
    path = tmp_path / "fp32" / generated.RECORD
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "dtype"}))
    with pytest.raises(ValueError, match=r"dtype was 'float32', now 'bfloat16'"):
        generate_data(options(root, tmp_path / "fp32", num_samples=9, resume=True, dtype="bfloat16"))
    assert generate_data(options(root, tmp_path / "fp32", num_samples=9, resume=True))["dtype"] == "float32"


@pytest.mark.parametrize("flags, message", [
    (["--kind", "poems"], "--kind must be one of auto, chat, text, both, got 'poems'"),
    (["--dtype", "float16"], "--dtype must be one of float32, bfloat16, got 'float16'"),
    (["--top_p", "0"], "--top_p must be in (0, 1] (1 = no nucleus cut), got 0.0"),
    (["--num_samples", "0"], "--num_samples must be a whole number >= 1, got 0"),
])
def test_bad_options_give_one_line_before_loading_anything(root, tmp_path, capsys, flags, message):
    code = cli(["generate-data", str(root / "teacher"), "--output_dir", str(tmp_path / "out"), *flags])
    assert code == 1 and capsys.readouterr().err.strip() == f"delta-attention generate-data: error: {message}"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ grounded prompts


def test_the_built_in_set_has_grounded_prompts_and_a_quarter_of_the_chat_samples_answer_them():
    chat = [(i, p) for i, p in enumerate(load_prompts()) if p["kind"] == "chat"]
    grounded = [p for _, p in chat if generated.is_grounded(p)]
    assert len(grounded) >= 12 and all(p["category"] == "grounded" for p in grounded)
    order = generated.chat_prompt_order(chat, 0, 64, 0.25)
    flags = generated.grounded_samples(64, 0.25)
    assert sum(flags) == 16 and flags[:8] == [False, False, False, True] * 2  # evenly spaced
    assert [generated.is_grounded(chat[i][1]) for i in order] == flags  # grounded samples take grounded prompts
    assert len({order[i] for i in range(64) if flags[i]}) == 16 - max(0, 16 - len(grounded))  # no repeat too soon
    # a longer run keeps the shorter run's assignment (a resume with more samples adds, changes nothing)
    assert generated.chat_prompt_order(chat, 0, 100, 0.25)[:64] == order
    assert not any(generated.is_grounded(chat[i][1]) for i in generated.chat_prompt_order(chat, 0, 64, 0.0))


def test_a_grounded_passage_is_training_text_from_a_sentence_start_drawn_by_the_seed_alone():
    texts = [" ".join(f"d{d}s{s}w{w}" + ("." if w == 9 else "") for s in range(40) for w in range(10))
             for d in range(3)]  # three documents of 40 ten-word sentences
    passages = [generated.grounded_passage(texts, sample_seed(0, "chat", i)) for i in range(40)]
    assert passages == [generated.grounded_passage(texts, sample_seed(0, "chat", i)) for i in range(40)]
    for passage in passages:
        words = passage.split()
        document = words[0].split("s")[0]
        assert all(word.startswith(document + "s") for word in words)  # one document, its words in order
        assert " ".join(words) in texts[int(document[1:])]
        assert words[0].endswith("w0") and words[-1].endswith("w9.")  # whole sentences
        assert 50 <= len(words) <= generated.PASSAGE_WORDS[1]
    assert len(set(passages)) >= 35 and len({p.split("s")[0] for p in passages}) == 3  # varied


def test_grounded_samples_quote_the_passages_text_and_resume_like_the_rest(root, tmp_path):
    words = [f"w{30 + (i * 7) % 50}" + ("." if i % 8 == 7 else "") for i in range(400)]
    (tmp_path / "passages.txt").write_text(" ".join(words) + "\n")
    lines = [{"kind": "chat", "category": "test", "prompt": "w1 w2"},
             {"kind": "chat", "category": "grounded", "prompt": "{passage}\n\nw3 w4"}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    settings = dict(kind="chat", prompts=str(tmp_path / "prompts.jsonl"), passages=str(tmp_path / "passages.txt"),
                    grounded_share=0.5, num_samples=6, shard_size=2, max_new_tokens=4)
    record = generate_data(options(root, tmp_path / "gen", **settings))
    samples = rows(tmp_path / "gen")["chat"]
    assert record["grounded_share"] == 0.5 and record["passages"] == str(tmp_path / "passages.txt")
    assert [r["category"] for r in samples] == ["test", "grounded"] * 3
    for row in samples[1::2]:
        passage, request = row["prompt"].split("\n\n")
        assert request == "w3 w4" and passage in " ".join(words) and len(passage.split()) >= 50
        assert row["messages"][0]["content"] == row["prompt"]
    assert len({r["prompt"] for r in samples[1::2]}) == 3
    assert generate_data(options(root, tmp_path / "gen2", batch_size=1, **settings)) and \
        rows(tmp_path / "gen2") == rows(tmp_path / "gen")  # the seed decides the passages, not the batching
    with pytest.raises(ValueError, match="grounded_share was 0.5, now 0.25"):
        generate_data(options(root, tmp_path / "gen", resume=True, **{**settings, "grounded_share": 0.25}))
    # --grounded_share 0: the grounded prompt is never answered
    generate_data(options(root, tmp_path / "none", **{**settings, "grounded_share": 0.0}))
    assert {r["category"] for r in rows(tmp_path / "none")["chat"]} == {"test"}


@pytest.mark.parametrize("flags, message", [
    (["--grounded_share", "1.5"], "--grounded_share must be in [0, 1] (0 = no grounded prompts), got 1.5"),
    (["--passages", "builtin:heldout"], "builtin:heldout is the evaluation split (never trained on)"),
])
def test_bad_grounded_options_give_one_line_before_loading_anything(root, tmp_path, capsys, flags, message):
    code = cli(["generate-data", str(root / "teacher"), "--output_dir", str(tmp_path / "out"), *flags])
    assert code == 1 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
