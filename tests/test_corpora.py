"""The offline corpora: the cross-domain split never reaches training, `builtin:train` follows its weights, the
document readers, and cross-domain perplexity beside the held-out one in `distill`, `evaluate`, the card and the
benchmark table."""

from __future__ import annotations

import hashlib
import json
import math
import re

import pytest

from conftest import tiny_llama_teacher, tiny_tokenizer
from delta_attention.conversion.data import assets
from delta_attention.conversion.data.text import (
    DataOptions,
    builtin_documents,
    evaluation_texts,
    evaluation_windows,
    load_texts,
    training_blocks,
)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ByteTokenizer:
    """One token per UTF-8 byte: windows decode back to the text they were cut from."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


# ------------------------------------------------------------------------------------ the splits (real assets)


def test_crossdomain_and_heldout_documents_never_reach_training():
    crossdomain = assets.documents("crossdomain")
    heldout = assets.documents("heldout")
    assert {d.corpus for d in crossdomain} == set(assets.CROSSDOMAIN) == {"email", "bible"}
    assert {d.corpus for d in heldout} == set(assets.TRAIN_WEIGHTS) == {"sotu", "shakespeare", "brown", "django"}
    never = {digest(d.text) for d in crossdomain + heldout}
    never_ids = {(d.corpus, d.name) for d in crossdomain + heldout}
    assert len(never) == len(crossdomain) + len(heldout)  # no two evaluation documents are the same text

    mixes = ["builtin:train", "builtin:train:sotu", "builtin:train:shakespeare", "builtin:train:brown",
             "builtin:train:django", "builtin:train:sotu=1,shakespeare=1,brown=1", "builtin:train:brown=5,sotu=0.1"]
    for source in mixes:
        docs = builtin_documents(source)
        assert docs and all(d.split == "train" for d in docs)
        assert not never_ids & {(d.corpus, d.name) for d in docs}, source
        texts = load_texts(source)["text"]  # what training_blocks tokenises
        assert not never & {digest(t) for t in texts}, source
    # every training document is in the unweighted training split, and nothing else is
    assert {(d.corpus, d.name) for d in assets.documents("train")}.isdisjoint(never_ids)
    assert len(assets.documents("train")) + len(heldout) + len(crossdomain) == sum(
        len(list((assets.cache_dir() / "text" / c.name).glob("*.txt"))) for c in assets.CORPORA)


def test_the_django_pages_train_by_default_and_keep_their_heldout_part():
    """django trains in the default mix (a quarter of the text, the thirteenth sitting's mix exactly) but never on
    its held-out pages, which `builtin:heldout` scores beside the other corpora's."""
    assert assets.TRAIN_WEIGHTS == {"sotu": 0.2625, "shakespeare": 0.1875, "brown": 0.30, "django": 0.25}
    assert builtin_documents("builtin:train") == builtin_documents(
        "builtin:train:sotu=0.2625,shakespeare=0.1875,brown=0.3,django=0.25")
    heldout = builtin_documents("builtin:heldout:django")
    assert [d.name for d in heldout] == list(assets.HELDOUT_DJANGO) and all(d.split == "heldout" for d in heldout)
    assert builtin_documents("builtin:heldout")[-len(heldout):] == heldout
    mix = builtin_documents("builtin:train")
    pages = [d for d in mix if d.corpus == "django"]
    assert pages and all(d.split == "train" for d in mix)
    assert not {d.name for d in pages} & set(assets.HELDOUT_DJANGO)
    assert not {digest(d.text) for d in heldout} & {digest(t) for t in load_texts("builtin:train:django")["text"]}
    share = sum(d.path.stat().st_size for d in pages) / sum(d.path.stat().st_size for d in mix)
    assert share == pytest.approx(0.25, abs=0.01)
    # the in-domain figures measured before django joined: the three older corpora's held-out documents
    older = builtin_documents("builtin:heldout:sotu,shakespeare,brown")
    assert older + heldout == builtin_documents("builtin:heldout") and len(older) == 21
    # the pages read as prose: no reST roles, directives or title underlines left; release notes left out
    every = assets.documents("train", corpora=["django"]) + heldout
    assert len(every) > 250 and not any(d.name.startswith("releases") for d in every)
    text = "".join(d.text for d in every)
    assert ":setting:`" not in text and ":doc:`" not in text and "\n.. " not in text
    assert not re.search(r"\n([=~^-])\1{2,}\n", text)  # title underlines (a table's borders stay)
    tutorial = next(d.text for d in heldout if d.name == "intro_tutorial01")
    assert tutorial.startswith("Writing your first Django app, part 1\n")


@pytest.mark.parametrize("source, problem", [
    ("builtin:crossdomain", r"builtin:crossdomain is the evaluation split \(never trained on\); train on builtin:train"),
    ("builtin:heldout", r"builtin:heldout is the evaluation split"),
    ("builtin:heldout:email", r"builtin:heldout:email is the evaluation split"),
    ("builtin:heldout:sotu", r"builtin:heldout:sotu is the evaluation split"),
    ("builtin:train:email=1", r"email is a cross-domain corpus, held out of training whole; mix the training "
                              r"corpora sotu, shakespeare, brown, django$"),
    ("builtin:train:sotu=1,bible=1", r"bible is a cross-domain corpus"),
    ("builtin:train:sotu=x", r"builtin:train:sotu=x: the weight of 'sotu' is not a number \('x'\)"),
    ("builtin:train:sotu=0", r"the weight of sotu must be > 0, got 0.0"),
    ("builtin:train:novels", r"unknown corpus 'novels'; the offline corpora are sotu, shakespeare, brown, django, "
                             r"email"),
    ("builtin:everything", r"unknown built-in set 'builtin:everything'; use builtin:train\[:CORPUS=WEIGHT"),
])
def test_training_refuses_every_evaluation_set_before_reading_data(source, problem):
    with pytest.raises(ValueError, match=problem):
        DataOptions(dataset=source).validate()
    with pytest.raises(ValueError, match=problem):
        training_blocks(DataOptions(dataset=source), ByteTokenizer())


def test_heldout_sets_by_corpus_and_the_missing_column_error():
    assert [d.name for d in builtin_documents("builtin:heldout:sotu")] == list(assets.HELDOUT_SOTU)
    assert [d.name for d in builtin_documents("builtin:heldout:brown")] == list(assets.HELDOUT_BROWN)
    bible = builtin_documents("builtin:heldout:bible")
    assert bible == assets.documents("crossdomain", corpora=["bible"]) and len(bible) == 66
    assert [d.corpus for d in builtin_documents("builtin:crossdomain")] == ["email"] * (
        len(builtin_documents("builtin:heldout:email"))) + ["bible"] * 66
    with pytest.raises(ValueError, match="unknown corpus 'psalms'"):
        builtin_documents("builtin:heldout:psalms")
    # several corpora: their parts in the order named, each once
    several = builtin_documents("builtin:heldout:brown, bible,brown")
    assert several == builtin_documents("builtin:heldout:brown") + bible
    with pytest.raises(ValueError, match="builtin:heldout:, names no corpus"):
        builtin_documents("builtin:heldout:,")
    # built-in sets have one column, `text`, like any other source (a chat loader asking for `messages` is told)
    with pytest.raises(ValueError, match=r"builtin:heldout:bible: no column 'messages' \(columns: \['text'\]\); "
                                         r"pass --messages_column"):
        load_texts("builtin:heldout:bible", text_column="messages", column_flag="--messages_column")


def test_the_new_corpora_read_as_plain_english():
    bible = {d.name: d.text for d in assets.documents("crossdomain", corpora=["bible"])}
    assert "In the beginning God created the heaven and the earth." in bible["01_genesis"]
    email = assets.documents("crossdomain", corpora=["email"])
    first = email[0].text
    assert first.startswith("Subject: ") and "Received:" not in first and "Return-Path" not in first
    assert all(len(d.text) > 2_000 for d in email)
    brown = {d.name: d.text for d in assets.documents("train", corpora=["brown"])}
    assert "/nn" not in brown["ca02"] and " ." not in brown["ca02"] and "``" not in brown["ca02"]


# ------------------------------------------------------------------------------------------- the training mix


def test_builtin_train_follows_its_weights_in_every_prefix():
    def shares(docs):
        sizes = {}
        for d in docs:
            sizes[d.corpus] = sizes.get(d.corpus, 0) + d.path.stat().st_size
        return {name: size / sum(sizes.values()) for name, size in sizes.items()}

    mix = assets.training_documents()
    assert mix == assets.training_documents()  # fixed: no seed, no randomness
    for name, share in shares(mix).items():
        assert share == pytest.approx(assets.TRAIN_WEIGHTS[name], abs=0.01)
    for fraction in (0.1, 0.5):  # what a stream reads first keeps the mix
        for name, share in shares(mix[: int(len(mix) * fraction)]).items():
            assert share == pytest.approx(assets.TRAIN_WEIGHTS[name], abs=0.05)
    # the corpus with the least text for its weight gives all of its training documents
    limiting = min(assets.TRAIN_WEIGHTS, key=lambda n: sum(d.path.stat().st_size for d in assets.documents(
        "train", corpora=[n])) / assets.TRAIN_WEIGHTS[n])
    assert sum(d.corpus == limiting for d in mix) == len(assets.documents("train", corpora=[limiting]))
    assert len({(d.corpus, d.name) for d in mix}) == len(mix)  # no document repeats
    even = shares(builtin_documents("builtin:train:sotu=1,brown=1"))
    assert set(even) == {"sotu", "brown"} and even["sotu"] == pytest.approx(0.5, abs=0.01)


# ------------------------------------------------------------------------------------------ document readers


def test_brown_tags_are_dropped_and_punctuation_attached():
    tagged = ("\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' was/bedz found/vbn ,/, "
              "(/( 1/2/cd )/) ./.\n\n\nIt/pps ended/vbd ./.\n\n\n\tA/at new/jj paragraph/nn ?/.\n")
    assert assets.brown_plain_text(tagged) == ('The jury said "no evidence" was found, (1/2). It ended.\n\n'
                                               "A new paragraph?\n")
    # continuation lines (no tab) stay in their paragraph; the first paragraph needs no tab
    assert assets.brown_plain_text("It/pps ended/vbd ./.\n\nSo/rb did/dod we/ppss ./.\n") == "It ended. So did we.\n"


def test_rest_pages_become_plain_text():
    rest = (".. _sessions:\n\n===================\nHow to use sessions\n===================\n\n"
            ".. module:: django.contrib.sessions\n   :synopsis: Sessions.\n\n"
            "Edit the :setting:`MIDDLEWARE` setting (see :doc:`the middleware\n</ref/middleware>`) and call\n"
            ":meth:`~django.http.HttpRequest.get_host` or ``request.session``::\n\n    request.session[\"k\"] = 1\n\n"
            ".. warning::\n\n    Read :ref:`this <why>` first.\n\nExample\n-------\n\n::\n\n    x = 1\n")
    assert assets.rest_plain_text(rest) == (
        "How to use sessions\n\nEdit the `MIDDLEWARE` setting (see the middleware) and call\n"
        "`get_host` or `request.session`:\n\n    request.session[\"k\"] = 1\n\n    Read this first.\n\n"
        "Example\n\n    x = 1\n")


def test_email_keeps_subject_and_plain_body_only():
    raw = (b"From: someone@example.com\nReceived: from a by b\nSubject: Re:  meeting\n\ttomorrow\n"
           b"MIME-Version: 1.0\nContent-Type: multipart/alternative; boundary=XX\n\n--XX\n"
           b"Content-Type: text/plain; charset=us-ascii\n\nSee you at ten.  \r\n> quoted line\n\n--XX\n"
           b"Content-Type: text/html\n\n<p>See you</p>\n--XX--\n")
    assert assets.email_plain_text(raw) == "Subject: Re: meeting tomorrow\n\nSee you at ten.\n> quoted line\n"
    html_only = b"Subject: ad\nContent-Type: text/html\n\n<p>buy</p>\n"
    assert assets.email_plain_text(html_only) is None
    odd_charset = b"Subject: x\nContent-Type: text/plain; charset=klingon\n\ncaf\xe9\n"
    assert assets.email_plain_text(odd_charset) == "Subject: x\n\ncaf\xe9\n"


# ------------------------------------------------------------------------------------------ evaluation windows


def test_evaluation_windows_give_each_crossdomain_corpus_an_equal_share():
    groups = evaluation_texts("builtin:crossdomain")
    assert len(groups) == 2
    windows = evaluation_windows("builtin:crossdomain", ByteTokenizer(), 64, 11)
    assert windows.shape == (11, 64)
    sources = []
    for window in windows:
        text = bytes(window.tolist()).decode("utf-8", errors="ignore")[8:-8]  # a cut may split a character
        sources.append([i for i, texts in enumerate(groups) if any(text in t for t in texts)])
    assert sources == [[0]] * 6 + [[1]] * 5  # e-mail then the Bible, 6 + 5 windows
    # one corpus is one group; any other source too
    assert len(evaluation_texts("builtin:heldout:bible")) == 1
    assert evaluation_windows("builtin:heldout:bible", ByteTokenizer(), 64, 3).shape == (3, 64)


# ------------------------------------------------------------------------------- reports: distill, card, bench


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An untrained tiny Llama teacher (with the tiny word tokenizer), its conversion, and three text files."""
    from delta_attention.conversion.converter.pipeline import ConversionSettings, convert

    root = tmp_path_factory.mktemp("corpora")
    teacher = tiny_llama_teacher(num_hidden_layers=2).eval()
    teacher.save_pretrained(root / "teacher")
    tiny_tokenizer().save_pretrained(root / "teacher")
    settings = ConversionSettings(keep_attention="0", init="copy", calibration_tokens=128, calibration_seq_len=32,
                                  chunk_size=16, bf16=False)
    words = lambda n, k: " ".join(f"w{(i * k) % 90}" for i in range(n))  # noqa: E731
    convert(str(root / "teacher"), out=root / "student", settings=settings, calibration_texts=[words(500, 7)],
            progress=False, log=lambda *a: None)
    for name, k in (("train", 7), ("eval", 11), ("other", 13)):
        (root / f"{name}.txt").write_text(words(4000, k))
    return root


def test_distill_reports_crossdomain_perplexity_after_each_stage(converted, tmp_path):
    from delta_attention.conversion.evaluation.perplexity import perplexity
    from delta_attention.conversion.loading import load_model
    from delta_attention.conversion.publishing.cards import results_table
    from delta_attention.conversion.training.distill import DistillOptions, _crossdomain_source, run_distill
    from delta_attention.conversion.training.lora import LoraOptions
    from delta_attention.conversion.training.loop import TrainingOptions

    other = str(converted / "other.txt")
    distill = DistillOptions(student=str(converted / "student"), output_dir=str(tmp_path / "run"),
                             eval_dataset=str(converted / "eval.txt"), crossdomain_dataset=other, eval_tokens=256,
                             stage1_tokens=4 * 4 * 32, stage2_tokens=4 * 4 * 32, agreement=False)
    results = run_distill(distill, DataOptions(dataset=str(converted / "train.txt"), seq_len=32),
                          TrainingOptions(batch_size=4, mixed_precision="no"), LoraOptions(lora_r=4))

    windows = evaluation_windows(other, tiny_tokenizer(), 32, 8)
    teacher, _ = load_model(str(converted / "teacher"))
    merged, _ = load_model(str(tmp_path / "run" / "model"))
    stage1, _ = load_model(str(tmp_path / "run" / "stage1" / "model"))
    assert results["crossdomain_dataset"] == other
    assert results["teacher_crossdomain_ppl"] == pytest.approx(perplexity(teacher, windows), rel=1e-5)
    assert results["stage1"]["crossdomain_ppl"] == pytest.approx(perplexity(stage1, windows), rel=1e-4)
    assert results["stage2"]["crossdomain_ppl"] == pytest.approx(perplexity(merged, windows), rel=1e-4)
    assert results["stage2"]["crossdomain_ppl"] != pytest.approx(results["stage2"]["heldout_ppl"], rel=1e-3)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["stage2"]["crossdomain_ppl"] == results["stage2"]["crossdomain_ppl"]

    table = results_table(results).splitlines()
    assert table[0] == ("| model | held-out perplexity (float32) | vs teacher | cross-domain perplexity | "
                        "vs teacher |")
    s2 = results["stage2"]
    assert table[5] == (f"| after stage 2 ({s2['tokens']:,} tokens) | {s2['heldout_ppl']:.2f} | "
                        f"{s2['heldout_ppl'] / results['teacher_ppl']:.2f}x | {s2['crossdomain_ppl']:.2f} | "
                        f"{s2['crossdomain_ppl'] / results['teacher_crossdomain_ppl']:.2f}x |")
    assert table[-1] == "Cross-domain perplexity on `other.txt`; never trained on."
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "| cross-domain perplexity | vs teacher |" in card
    # auto: the built-in cross-domain set goes with a built-in evaluation set only
    assert _crossdomain_source(DistillOptions(eval_dataset="builtin:heldout")) == "builtin:crossdomain"
    assert _crossdomain_source(DistillOptions(eval_dataset="my_eval.txt")) == ""


def test_results_table_without_crossdomain_is_unchanged():
    from delta_attention.conversion.publishing.cards import results_table

    results = {"teacher_ppl": 10.0, "converted_ppl": 40.0, "eval_precision": "float32",
               "stage1": {"tokens": 1000, "heldout_ppl": 12.5}}
    assert results_table(results) == ("| model | held-out perplexity (float32) | vs teacher |\n|---|---|---|\n"
                                      "| teacher | 10.00 | 1.00x |\n| converted, untrained | 40.00 | 4.00x |\n"
                                      "| after stage 1 (1,000 tokens) | 12.50 | 1.25x |")
    crossed = dict(results, teacher_crossdomain_ppl=20.0, converted_crossdomain_ppl=90.0,
                   crossdomain_dataset="builtin:crossdomain", stage1={"tokens": 1000, "heldout_ppl": 12.5})
    assert results_table(crossed).splitlines()[3:] == [
        "| converted, untrained | 40.00 | 4.00x | 90.00 | 4.50x |",
        "| after stage 1 (1,000 tokens) | 12.50 | 1.25x | - | - |",
        "",
        "Cross-domain perplexity on `builtin:crossdomain`: corpora of other domains and eras held out of training "
        "whole (e-mail, King James Bible); never trained on.",
    ]


def test_bench_table_has_crossdomain_columns():
    from delta_attention.scripts.bench_distill import markdown

    model = {"teacher_ppl": 30.0, "converted_ppl": 200.0, "teacher_crossdomain_ppl": 40.0,
             "crossdomain_dataset": "builtin:crossdomain", "wall_seconds": 600,
             "stage1": {"heldout_ppl": 40.0, "crossdomain_ppl": 60.0, "tokens_per_s": 500, "tokens": 2048},
             "stage2": {"heldout_ppl": 36.0, "crossdomain_ppl": 52.0, "tokens_per_s": 200, "tokens": 1024}}
    report = {"threads": 2, "minutes_per_model": 10, "seq_len": 512, "batch_size": 4, "packing": "boundary",
              "mixed_precision": "bf16", "teacher_finetune_tokens_per_s": 300, "models": {"hybrid": model}}
    lines = markdown(report).splitlines()
    assert lines[2].startswith("| model | teacher ppl | untrained | after stage 1 | after stage 2 | vs teacher | "
                               "cross-domain: teacher | after stage 1 | after stage 2 | vs teacher |")
    assert lines[4] == ("| hybrid | 30.00 | 200.0 | 40.00 | 36.00 | 1.20x | 40.00 | 60.00 | 52.00 | 1.30x | 500 | "
                        "200 | 2,048 + 1,024 | 10 min |")
    assert lines[6].startswith("Cross-domain perplexity on `builtin:crossdomain`")
    old = dict(model)
    del old["teacher_crossdomain_ppl"]
    report["models"] = {"hybrid": old}
    assert "| 1.20x | - | - | - | - | 500 |" in markdown(report)


def test_evaluate_scores_each_set_with_equal_corpus_shares_and_one_row_per_set():
    from delta_attention.conversion.evaluation.perplexity import perplexity_of_texts
    from delta_attention.conversion.evaluation.report import perplexity_rows, set_perplexity

    from conftest import tiny_delta_model

    model, tokenizer = tiny_delta_model(seed=1), tiny_tokenizer()
    short = [" ".join(f"w{i % 90}" for i in range(80))]
    long = [" ".join(f"w{(i * 7) % 90}" for i in range(400)), " ".join(f"w{(i * 3) % 90}" for i in range(400))]
    result = set_perplexity(model, tokenizer, [short, long], window=64, stride=32, max_tokens=100)
    parts = [perplexity_of_texts(model, tokenizer, texts, 64, 32, 50) for texts in (short, long)]
    assert [p["tokens"] for p in parts] == [50, 50] and result["tokens"] == 100
    assert result["nll"] == pytest.approx((parts[0]["nll"] + parts[1]["nll"]) / 2, rel=1e-9)
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"]), rel=1e-12)

    student = {"perplexity_sets": {"builtin:heldout": {"perplexity": 36.0, "tokens": 16384},
                                   "builtin:crossdomain": {"perplexity": 60.0, "tokens": 16000}}}
    teacher = {"perplexity_sets": {"builtin:heldout": {"perplexity": 30.0, "tokens": 16384},
                                   "builtin:crossdomain": {"perplexity": 40.0, "tokens": 16000}}}
    assert perplexity_rows([student, teacher], teacher=True).splitlines() == [
        "| `builtin:heldout` | 36.00 | 30.00 |",
        "| `builtin:heldout` vs teacher | 1.20x | 1.00x |",
        "| `builtin:heldout` tokens | 16,384 | 16,384 |",
        "| `builtin:crossdomain` | 60.00 | 40.00 |",
        "| `builtin:crossdomain` vs teacher | 1.50x | 1.00x |",
        "| `builtin:crossdomain` tokens | 16,000 | 16,000 |",
    ]


def test_bench_distill_trains_on_the_dataset_it_is_given_and_refuses_a_bad_one_before_loading(monkeypatch):
    from delta_attention.conversion.converter import sources
    from delta_attention.scripts.bench_distill import BenchDistillOptions, markdown, run

    def never(*args, **kwargs):
        raise AssertionError("loaded the teacher before checking --dataset")

    monkeypatch.setattr(sources, "load_source", never)
    with pytest.raises(ValueError, match="builtin:heldout is the evaluation split"):
        run(BenchDistillOptions(dataset="builtin:train@0.5+builtin:heldout@0.5", output_dir="unused"))
    report = {"threads": 2, "minutes_per_model": 60, "seq_len": 512, "batch_size": 4, "packing": "boundary",
              "mixed_precision": "bf16", "dataset": "builtin:train@0.5+generated:gen@0.5",
              "teacher_finetune_tokens_per_s": 300, "models": {}}
    assert "data `builtin:train@0.5+generated:gen@0.5`" in markdown(report).splitlines()[0]


def test_evaluate_keeps_a_heldout_corpus_list_as_one_set(tmp_path):
    from delta_attention.conversion.data.text import source_list
    from delta_attention.conversion.evaluation.report import EvaluateOptions, run_evaluate

    from conftest import tiny_delta_model

    assert source_list("builtin:heldout:sotu, shakespeare,brown,builtin:crossdomain") == [
        "builtin:heldout:sotu,shakespeare,brown", "builtin:crossdomain"]
    # a corpus name continues only a builtin:heldout: list; elsewhere it stays a source of its own
    assert source_list("builtin:heldout,brown") == ["builtin:heldout", "brown"]
    assert source_list("builtin:crossdomain,bible,,") == ["builtin:crossdomain", "bible"]

    folder = tmp_path / "model"
    tiny_delta_model(seed=2).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    options = EvaluateOptions(model=str(folder), tasks="perplexity", max_tokens=64, window=32, stride=16,
                              dataset="builtin:heldout:sotu,shakespeare,builtin:heldout:django",
                              output_dir=str(tmp_path / "report"))
    sets = run_evaluate(options)["models"]["model"]["perplexity_sets"]
    assert list(sets) == ["builtin:heldout:sotu,shakespeare", "builtin:heldout:django"]
    assert all(row["tokens"] == 64 and row["perplexity"] > 1 for row in sets.values())
