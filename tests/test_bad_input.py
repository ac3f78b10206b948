"""Bad input never loses data or leaves a half-written folder, and gets one clear line (convert, distill, finetune,
evaluate, the option parser)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import tiny_delta_model, tiny_tokenizer
from delta_attention.conversion import ConversionSettings, convert
from delta_attention.conversion.output_folder import RUN_MARKER
from delta_attention.scripts.cli import main as cli_main

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAST = ["--calibration-seq-len", "32", "--calibration-tokens", "64", "--init", "copy", "--quiet"]


def save_llama(folder, seed=0, tokenizer=True, **overrides):
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides})).save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama teacher and its conversion (layer 0 kept), plus a text file to train on."""
    root = tmp_path_factory.mktemp("pair")
    save_llama(root / "teacher")
    settings = ConversionSettings(keep_attention="0", init="copy", calibration_tokens=64, calibration_seq_len=32,
                                  chunk_size=16, bf16=False)
    convert(str(root / "teacher"), root / "student", settings, calibration_texts=["w1 w2 w3 " * 200],
            progress=False, log=lambda *a: None)
    (root / "train.txt").write_text(" ".join(f"w{i % 50}" for i in range(3000)))
    return root


def cli_error(argv, capsys) -> str:
    code = cli_main(argv)
    err = capsys.readouterr().err
    assert code == 1, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err  # one line, no traceback
    return errors[0]


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------- --overwrite loses nothing


def a_previous_run(folder):
    """A run folder as `finetune` leaves it, with a file of the user's inside."""
    folder.mkdir()
    (folder / RUN_MARKER).write_text('{"command": "finetune"}')
    (folder / "results.json").write_text('{"steps": 3}')
    (folder / "my-notes.txt").write_text("precious")
    return snapshot(folder)


def test_overwrite_with_missing_data_keeps_the_old_run(pair, tmp_path, capsys):
    before = a_previous_run(tmp_path / "s")
    err = cli_error(["finetune", str(pair / "student"), "--output_dir", str(tmp_path / "s"), "--overwrite",
                     "--dataset", str(tmp_path / "missing.txt")], capsys)
    assert "missing.txt" in err
    assert snapshot(tmp_path / "s") == before and hidden(tmp_path) == []


def test_the_current_directory_and_parents_of_the_input_are_never_replaced(pair, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    err = cli_error(["finetune", str(pair / "student"), "--output_dir", ".", "--overwrite", "--force_overwrite",
                     "--dataset", str(pair / "train.txt")], capsys)
    assert "is the current directory" in err and (work / "keep.txt").read_text() == "mine"
    err = cli_error(["convert", str(pair / "teacher"), "--out", ".", "--overwrite", *FAST], capsys)
    assert "is the current directory" in err
    err = cli_error(["convert", str(pair / "teacher"), "--out", str(pair), "--overwrite", "--force_overwrite", *FAST],
                    capsys)
    assert "would replace the input" in err and (pair / "teacher" / "config.json").is_file()
    err = cli_error(["convert", str(pair / "teacher"), "--out", str(work.parent), "--overwrite", *FAST], capsys)
    assert "a parent of the current directory" in err


def test_convert_overwrite_refuses_a_folder_it_did_not_write(pair, tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"\xff\xd8")
    err = cli_error(["convert", str(pair / "teacher"), "--out", str(out), "--overwrite", *FAST], capsys)
    assert "not written by delta-attention" in err and "--force_overwrite" in err
    assert (out / "holiday.jpg").read_bytes() == b"\xff\xd8"
    # a folder this tool wrote is replaced by --overwrite alone; a foreign one with --force_overwrite
    assert cli_main(["convert", str(pair / "teacher"), "--out", str(out), "--overwrite", "--force_overwrite",
                     *FAST]) == 0
    assert not (out / "holiday.jpg").exists() and (out / "conversion.json").is_file()
    assert cli_main(["convert", str(pair / "teacher"), "--out", str(out), "--overwrite", *FAST]) == 0
    assert hidden(tmp_path) == []


def test_finetune_overwrite_replaces_the_run_only_when_the_new_one_is_complete(pair, tmp_path, monkeypatch):
    from delta_attention.conversion.training import finetune as finetune_module
    from delta_attention.conversion.training.finetune import FinetuneOptions, run_finetune
    from delta_attention.conversion.data.text import DataOptions
    from delta_attention.conversion.training.loop import TrainingOptions

    out = tmp_path / "run"
    before = a_previous_run(out)
    real_training = finetune_module.run_training
    seen = {}

    def training_while_checking(*args, **kwargs):
        seen["old run intact during training"] = snapshot(out) == before
        return real_training(*args, **kwargs)

    monkeypatch.setattr(finetune_module, "run_training", training_while_checking)
    options = FinetuneOptions(model=str(pair / "student"), output_dir=str(out), overwrite=True, max_tokens=2 * 4 * 16)
    data = DataOptions(dataset=str(pair / "train.txt"), seq_len=16)
    run_finetune(options, data, TrainingOptions(batch_size=4, mixed_precision="no"))
    assert seen == {"old run intact during training": True}
    assert not (out / "my-notes.txt").exists() and (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / RUN_MARKER).is_file() and hidden(tmp_path) == []

    # a replacing run that fails leaves the old folder as it was, and its own work where --resume finds it
    before = snapshot(out)

    def failing_training(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(finetune_module, "run_training", failing_training)
    with pytest.raises(KeyboardInterrupt):
        run_finetune(options, data, TrainingOptions(batch_size=4, mixed_precision="no"))
    assert snapshot(out) == before
    assert hidden(tmp_path) == [".run.overwrite"]


# ------------------------------------------------------------------------------- sources and outputs


def test_a_corrupt_source_tokenizer_is_an_error_unless_no_tokenizer(tmp_path, capsys):
    source = save_llama(tmp_path / "source")
    (source / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "broken"')
    out = tmp_path / "out"
    err = cli_error(["convert", str(source), "--out", str(out), *FAST], capsys)
    assert "tokenizer could not be loaded" in err and "--no_tokenizer" in err and not out.exists()
    assert cli_main(["convert", str(source), "--out", str(out), "--no_tokenizer", *FAST]) == 0
    assert not (out / "tokenizer.json").exists()
    card = (out / "README.md").read_text()
    assert "AutoTokenizer" not in card and "random token ids" in (out / "conversion.json").read_text()


def test_a_corrupt_source_config_or_weights_is_one_clear_line(tmp_path, capsys):
    source = save_llama(tmp_path / "source")
    (source / "config.json").write_text('{"model_type": "llama", ')
    err = cli_error(["convert", str(source), "--out", str(tmp_path / "out"), *FAST], capsys)
    assert "config.json could not be read" in err
    source = save_llama(tmp_path / "source2")
    weights = (source / "model.safetensors").read_bytes()
    (source / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    err = cli_error(["convert", str(source), "--out", str(tmp_path / "out"), *FAST], capsys)
    assert "weights could not be loaded" in err and not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_written_fails_before_converting(pair, tmp_path, capsys):
    err = cli_error(["convert", str(pair / "teacher"), "--out", "/sys/delta-attention-never", *FAST], capsys)
    assert "cannot write in /sys" in err
    (tmp_path / "a-file").write_text("x")
    err = cli_error(["convert", str(pair / "teacher"), "--out", str(tmp_path / "a-file" / "out"), *FAST], capsys)
    assert "is a file" in err


def test_missing_model_folders_are_one_clear_line(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    err = cli_error(["finetune", missing, "--output_dir", str(tmp_path / "o"), "--dataset", "builtin:train"], capsys)
    assert "no such model folder" in err and not (tmp_path / "o").exists()
    err = cli_error(["evaluate", missing, "--output_dir", str(tmp_path / "o")], capsys)
    assert "no such model folder" in err
    err = cli_error(["distill", missing, "--output_dir", str(tmp_path / "o")], capsys)
    assert "no such model folder" in err


# ------------------------------------------------------------------------------- options


def test_unknown_flags_and_bad_option_files_are_one_clear_line(pair, tmp_path, capsys):
    err = cli_error(["convert", str(pair / "teacher"), "--out", str(tmp_path / "o"), "--keep-atention", "0"], capsys)
    assert "unknown option(s) --keep-atention 0" in err
    bad_yaml = tmp_path / "recipe.yaml"
    bad_yaml.write_text("student: [unclosed\n")
    assert "is not valid YAML" in cli_error(["distill", str(bad_yaml)], capsys)
    bad_yaml.write_text("student: x\nstage_one_tokens: 5\n")
    assert "unknown option(s) ['stage_one_tokens']" in cli_error(["distill", str(bad_yaml)], capsys)
    assert "options file" in cli_error(["distill", str(tmp_path / "missing.yaml")], capsys)


def test_bad_stage_and_batch_values_are_one_clear_line(pair, tmp_path, capsys):
    base = ["distill", str(pair / "student"), "--output_dir", str(tmp_path / "o"), "--dataset", str(pair / "train.txt")]
    assert "--stages must name stages 1 and/or 2" in cli_error([*base, "--stages", "abc"], capsys)
    assert "batch_size" in cli_error([*base, "--batch_size", "0"], capsys)
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------- teacher and student


def test_a_teacher_that_is_not_the_source_is_refused(pair, tmp_path, capsys):
    base = ["distill", str(pair / "student"), "--output_dir", str(tmp_path / "o"), "--dataset", str(pair / "train.txt"),
            "--seq_len", "16", "--eval_tokens", "0"]
    other = save_llama(tmp_path / "other", seed=1)
    err = cli_error([*base, "--teacher", str(other)], capsys)
    assert "is not the model the student was converted from" in err and "embeddings differ" in err
    wider = save_llama(tmp_path / "wider", hidden_size=32, intermediate_size=48)
    err = cli_error([*base, "--teacher", str(wider)], capsys)
    assert "hidden_size 32 vs 64" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------- seeds, permissions, signals


def test_the_same_seed_gives_the_same_lora_run(pair, tmp_path):
    from delta_attention.conversion.training.finetune import FinetuneOptions, run_finetune
    from delta_attention.conversion.data.text import DataOptions
    from delta_attention.conversion.training.loop import TrainingOptions

    adapters = []
    for name in ("a", "b"):
        options = FinetuneOptions(model=str(pair / "student"), output_dir=str(tmp_path / name), max_tokens=2 * 4 * 16)
        run_finetune(options, DataOptions(dataset=str(pair / "train.txt"), seq_len=16),
                     TrainingOptions(batch_size=4, mixed_precision="no"))
        adapters.append(load_file(tmp_path / name / "adapter" / "adapter_model.safetensors"))
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])


def test_saved_folders_follow_the_umask(pair, tmp_path):
    previous = os.umask(0o022)
    try:
        convert(str(pair / "teacher"), tmp_path / "out", ConversionSettings(keep_attention="all", bf16=False),
                progress=False, log=lambda *a: None)
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_sigterm_during_a_save_leaves_no_staging_folder(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from delta_attention.conversion.saving import atomic_save

        def slow(folder):
            (folder / "weights").write_text("partial")
            print("writing", flush=True)
            time.sleep(60)

        atomic_save(slow, Path({str(tmp_path / "model")!r}))
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) != 0
    assert list(tmp_path.iterdir()) == []


def test_run_folders_are_marked_and_recognised(pair, tmp_path):
    from delta_attention.conversion.output_folder import written_by_this_tool

    model = tmp_path / "model"
    tiny_delta_model().save_pretrained(model)
    legacy = tmp_path / "legacy"
    (legacy / "stage1").mkdir(parents=True)
    (legacy / "results.json").write_text("{}")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "results.json").write_text("{}")
    assert written_by_this_tool(model) and written_by_this_tool(legacy) and written_by_this_tool(pair / "student")
    assert not written_by_this_tool(foreign) and not written_by_this_tool(pair / "teacher")
    assert json.loads((pair / "student" / "config.json").read_text())["model_type"] == "delta"
