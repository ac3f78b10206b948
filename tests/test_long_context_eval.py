"""Long-context evaluation: one pass in pieces equals one forward, position buckets hold the right tokens, the passkey
needle sits exactly at its depth on the token ids, the report shows absent buckets, bad specs get one line."""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import HYBRID_LAYERS, tiny_delta_model, tiny_tokenizer
from test_evaluate import CharTokenizer, find
from delta_attention.conversion.evaluation.long_context import (bucket_means, full_forward_nlls, long_document,
                                                                 long_perplexity, parse_buckets, token_nlls)
from delta_attention.conversion.evaluation.peak_memory import peak_memory
from delta_attention.conversion.evaluation.report import EvaluateOptions, run_evaluate
from delta_attention.conversion.evaluation.tasks import PASSKEY_FILLER, greedy_continuation, passkey_prompt
from delta_attention.scripts.cli import main as cli_main

TEXT = " ".join(f"w{(i * 13) % 90}" for i in range(200))  # 200 tokens of the tiny tokenizer


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A softmax model trained for 64 positions (the documents below run past that)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


MODELS = {
    "hybrid": lambda: tiny_delta_model(seed=4, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6),
    "all-delta": lambda: tiny_delta_model(seed=5, num_hidden_layers=2, layer_types=["linear_attention"] * 2),
    "llama": tiny_llama,
}


def random_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("piece_size", [1, 7, 64, 500])
def test_one_pass_in_pieces_scores_every_token_once_as_one_forward(kind, piece_size):
    model = MODELS[kind]()
    ids = random_ids(150)
    with torch.no_grad():
        logits = model(ids[None], use_cache=False).logits[0]  # [150, vocab]
    by_hand = -logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]  # token t scored from logits t - 1
    nlls, cache = token_nlls(model, ids, piece_size)
    assert nlls.shape == (149,)
    torch.testing.assert_close(nlls, by_hand, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(full_forward_nlls(model, ids), by_hand, rtol=1e-5, atol=1e-6)
    assert cache.get_seq_length() == 150


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("window, piece_size", [(7, 7), (64, 64), (64, 5), (7, 100)])
def test_reset_reading_scores_each_window_from_an_empty_cache(kind, window, piece_size):
    """Token t of the reset reading sees only its own window; a window's first token is scored by the previous
    window's last logits (each window's logits from a fresh forward, no cache), whatever the piece size."""
    model = MODELS[kind]()
    ids = random_ids(150, seed=2)
    by_hand = torch.empty(149)
    with torch.no_grad():
        for start in range(0, 150, window):
            piece = ids[start : start + window]
            logp = model(piece[None], use_cache=False).logits[0].log_softmax(-1)  # fresh: no earlier piece
            for j in range(len(piece) - 1):
                by_hand[start + j] = -logp[j, piece[j + 1]]
            if start + len(piece) < 150:  # the next piece's first token, scored by this piece's last logits
                by_hand[start + len(piece) - 1] = -logp[-1, ids[start + len(piece)]]
    nlls, cache = token_nlls(model, ids, piece_size, reset_every=window)
    torch.testing.assert_close(nlls, by_hand, rtol=1e-5, atol=2e-5)
    last_start = range(0, 150, window)[-1]
    assert cache.get_seq_length() == 150 - last_start  # the last piece's cache only
    whole = token_nlls(model, ids, piece_size)[0]
    assert not torch.allclose(nlls[window:], whole[window:], atol=1e-4)  # the carried context changes the scores


def test_context_ratio_is_whole_over_reset_per_bucket_and_one_when_the_reset_covers_the_document():
    tokenizer = tiny_tokenizer()
    model, edges = MODELS["hybrid"](), parse_buckets("0,40,120,256")
    result = long_perplexity(model, tokenizer, [TEXT], 200, edges, piece_size=32, progress=False, reset_window=50)
    ids = long_document(tokenizer, [TEXT], 200)
    reset = bucket_means(token_nlls(model, ids, 32, reset_every=50)[0], edges)
    assert result["reset"]["window"] == 50 and result["reset"]["buckets"] == reset
    for bucket, fresh in zip(result["buckets"], reset):
        assert bucket["reset_perplexity"] == fresh["perplexity"]
        assert bucket["context_ratio"] == pytest.approx(math.exp(bucket["nll"] - fresh["nll"]), rel=1e-9)
    assert result["buckets"][0]["context_ratio"] == pytest.approx(1.0, abs=1e-4)  # positions < 40 see the same tokens
    covering = long_perplexity(model, tokenizer, [TEXT], 200, edges, piece_size=32, progress=False, reset_window=256)
    assert [b["context_ratio"] for b in covering["buckets"]] == pytest.approx([1.0, 1.0, 1.0], abs=1e-4)
    short = long_perplexity(model, tokenizer, [TEXT], 100, edges + [512], piece_size=32, progress=False,
                            reset_window=50)
    assert short["buckets"][-1]["context_ratio"] is None and short["buckets"][-1]["reset_perplexity"] is None
    assert "reset" not in long_perplexity(model, tokenizer, [TEXT], 100, edges, 32, progress=False)


def test_buckets_hold_the_tokens_at_their_positions_and_absent_ones_stay_absent():
    model = MODELS["hybrid"]()
    ids = random_ids(100, seed=1)
    with torch.no_grad():
        logp = model(ids[None]).logits[0].log_softmax(-1)
    nll_at = {t: -logp[t - 1, ids[t]].item() for t in range(1, 100)}  # position t: t tokens of context
    buckets = bucket_means(token_nlls(model, ids, piece_size=16)[0], [0, 10, 40, 64, 128, 256])
    expected = [range(1, 10), range(10, 40), range(40, 64), range(64, 100)]
    assert [b["tokens"] for b in buckets] == [9, 30, 24, 36, 0]
    for bucket, positions in zip(buckets, expected):
        mean = sum(nll_at[t] for t in positions) / len(positions)
        assert bucket["nll"] == pytest.approx(mean, rel=1e-5)
        assert bucket["perplexity"] == pytest.approx(torch.tensor(mean).exp().item(), rel=1e-5)
    assert buckets[-1] == {"start": 128, "end": 256, "tokens": 0, "nll": None, "perplexity": None}


def test_long_document_joins_texts_with_eos_up_to_the_cap():
    tokenizer = tiny_tokenizer()
    w = {f"w{i}": tokenizer.convert_tokens_to_ids(f"w{i}") for i in range(6)}
    ids = long_document(tokenizer, ["w1 w2 w3", "w4 w5", "w0"], max_tokens=6).tolist()
    assert ids == [w["w1"], w["w2"], w["w3"], tokenizer.eos_token_id, w["w4"], w["w5"]]
    with pytest.raises(ValueError, match="fewer than two tokens"):
        long_document(tokenizer, ["w1"], max_tokens=10)


def test_cache_at_the_end_is_bounded_for_delta_and_grows_for_softmax():
    tokenizer = tiny_tokenizer()
    edges = parse_buckets("0,64,256")
    delta, llama = ([long_perplexity(m, tokenizer, [TEXT], n, edges, 32, progress=False) for n in (80, 200)]
                    for m in (MODELS["all-delta"](), MODELS["llama"]()))
    assert delta[0]["cache_bytes"] == delta[1]["cache_bytes"] > 0  # delta states: the same after 80 and 200 tokens
    assert [r["cache_bytes"] for r in llama] == [2 * 2 * 2 * 8 * 4 * n for n in (80, 200)]  # layers, k/v, heads, dim
    assert llama[1]["tokens"] == 200 and llama[1]["buckets"][1]["tokens"] == 200 - 64


@pytest.mark.parametrize("length", [200, 1001])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_passkey_needle_starts_at_round_depth_times_filler_tokens(length, depth):
    tokenizer = CharTokenizer()
    ids = passkey_prompt(tokenizer, length, depth, passkey=54321).tolist()
    needle = tokenizer(" The pass key is 54321. Remember it. 54321 is the pass key. ")["input_ids"]
    question = tokenizer(" What is the pass key? The pass key is")["input_ids"]
    filler = length - len(needle) - len(question)
    start = round(depth * filler)
    assert len(ids) == length and ids[-len(question):] == question
    assert ids[start : start + len(needle)] == needle and find(ids, needle) == start
    around = ids[:start] + ids[start + len(needle) : -len(question)]  # the filler, cut at a token, needle removed
    assert around == (tokenizer(PASSKEY_FILLER)["input_ids"] * length)[:filler]


def test_passkey_prompt_refuses_a_bad_depth_or_a_length_without_room():
    with pytest.raises(ValueError, match="passkey depth 1.5 is outside 0..1"):
        passkey_prompt(CharTokenizer(), 500, 1.5, 12345)
    with pytest.raises(ValueError, match="a passkey prompt of 40 tokens cannot hold the needle and the question"):
        passkey_prompt(CharTokenizer(), 40, 0.5, 12345)


@pytest.mark.parametrize("kind", ["hybrid with a sliding layer", "llama"])
def test_greedy_continuation_reads_a_long_prompt_in_pieces_and_answers_as_one_generate(kind):
    """A 64k-token passkey prompt must not go through one forward (a sliding layer's mask would be [n, n])."""
    model = (tiny_delta_model(seed=3, num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6).eval()
             if kind != "llama" else tiny_llama(3))
    ids = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(1))
    widths = []
    hook = model.model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                                 with_kwargs=True)
    pieces = greedy_continuation(model, ids, 8, pad_token_id=0, prefill_piece=16)
    hook.remove()
    assert widths[:4] == [16, 16, 16, 1] and max(widths) == 16  # 49 prompt tokens in pieces, then one per step
    whole = greedy_continuation(model, ids, 8, pad_token_id=0, prefill_piece=1000)  # one generate over the prompt
    assert len(whole) >= 1 and pieces.tolist() == whole.tolist()


def test_peak_memory_sees_an_allocation():
    with peak_memory(torch.device("cpu")) as figures:
        block = torch.ones(16 * 2**20)  # 64 MiB, touched
    assert figures["bytes"] >= 60 * 2**20 and "resident" in figures["measure"]
    del block


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    MODELS["hybrid"]().save_pretrained(root / "model")
    tiny_llama().save_pretrained(root / "teacher")
    for name in ("model", "teacher"):
        tiny_tokenizer().save_pretrained(root / name)
    (root / "text").mkdir()
    (root / "text" / "doc.txt").write_text(TEXT)
    return root


def test_report_shows_model_and_teacher_side_by_side_with_absent_buckets(folders, tmp_path):
    options = EvaluateOptions(model=str(folders / "model"), teacher=str(folders / "teacher"),
                              tasks="long_ppl,passkey", dataset=str(folders / "text"), long_buckets="0,64,128,256,1024",
                              long_piece=48, passkey_lengths="48,96", passkey_depths="0,1",
                              output_dir=str(tmp_path / "report"))
    report = run_evaluate(options)
    model, teacher = (report["models"][n] for n in ("model", "teacher"))
    tokenizer = tiny_tokenizer()
    for result, fresh in ((model, MODELS["hybrid"]()), (teacher, tiny_llama())):
        ids = torch.tensor(tokenizer(TEXT)["input_ids"])
        nlls = full_forward_nlls(fresh, ids)
        assert result["long_ppl"]["buckets"][1]["nll"] == pytest.approx(nlls[63:127].mean().item(), rel=1e-5)
        assert [b["tokens"] for b in result["long_ppl"]["buckets"]] == [63, 64, 72, 0]
        assert set(result["peak_memory"]) == {"long_ppl", "passkey"}
        assert all(m["bytes"] >= 0 for m in result["peak_memory"].values())
        assert set(result["passkey_by_depth"]) == {48, 96} and set(result["passkey_by_depth"][96]) == {0.0, 1.0}
    assert teacher["max_position_embeddings"] == 64 and model["max_position_embeddings"] == 512
    assert teacher["long_ppl"]["cache_bytes"] == 2 * 2 * 2 * 8 * 4 * 200
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["models"]["teacher"]["long_ppl"]["buckets"][3]["perplexity"] is None  # absent, not zero
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "| 256-1k | absent | absent |" in markdown
    assert "| trained context (max_position_embeddings) | 512 | 64 |" in markdown
    assert f"| 128-256 | {model['long_ppl']['buckets'][2]['perplexity']:.2f} (72 tokens) |" in markdown
    assert "| 64-128 |" in markdown and " *" in markdown.split("| 64-128 |")[1].split("\n")[0]  # teacher past 64
    assert "## Peak memory per task" in markdown and "## Passkey retrieval by needle depth" in markdown


NOT_INCREASING, NOT_INTEGERS = "is not increasing from 0 or more", "is not a list of integers"


@pytest.mark.parametrize("spec, problem", [("0,2048,1024", NOT_INCREASING), ("0,2k", NOT_INTEGERS),
                                           ("2048", "has fewer than two edges"), ("-1,10", NOT_INCREASING),
                                           ("0,10,10", NOT_INCREASING), ("", NOT_INTEGERS)])
def test_bad_bucket_specs_give_one_clear_line(spec, problem, folders, capsys):
    with pytest.raises(ValueError, match=problem):
        parse_buckets(spec)
    code = cli_main(["evaluate", str(folders / "model"), f"--long_buckets={spec}", "--output_dir",
                     str(folders / "never")])  # the = form: argparse reads "-1,10" as a value
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [f"delta-attention evaluate: error: --long_buckets {spec!r} {problem}; give "
                                        f"increasing token positions, at least two, such as "
                                        f"--long_buckets 0,2048,8192,32768,65536"]
    assert not (folders / "never").exists()


def test_report_says_per_bucket_whether_the_long_context_helps(folders, tmp_path):
    options = EvaluateOptions(model=str(folders / "model"), teacher=str(folders / "teacher"), tasks="long_ppl",
                              dataset=str(folders / "text"), long_buckets="0,64,128,256", long_piece=48,
                              long_reset_window=64, output_dir=str(tmp_path / "report"))
    report = run_evaluate(options)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## Does the long context help?" in markdown and "independent windows of 64 tokens" in markdown
    model, teacher = (report["models"][n]["long_ppl"] for n in ("model", "teacher"))
    cells = [f"{run['buckets'][1]['reset_perplexity']:.2f} ({run['buckets'][1]['context_ratio']:.2f}x)"
             for run in (model, teacher)]
    assert f"| 64-128 | {cells[0]} | {cells[1]} |" in markdown
    assert f"| 0-64 | {model['buckets'][0]['reset_perplexity']:.2f} (1.00x) |" in markdown  # same tokens seen
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["models"]["model"]["long_ppl"]["reset"]["window"] == 64


def test_a_negative_reset_window_is_refused_before_loading(folders, capsys):
    code = cli_main(["evaluate", str(folders / "model"), "--long_reset_window=-1", "--output_dir",
                     str(folders / "never")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == ["delta-attention evaluate: error: --long_reset_window must be 0 (off) or a "
                                        "number of tokens, got -1"]
    assert not (folders / "never").exists()
