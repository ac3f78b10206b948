"""`delta-attention bench-speculative` on tiny models: every task and method, the report, the plot; the early-exit
draft shares the target's weights; prompt lookup and the assistant give the greedy tokens."""

import dataclasses
import json

import pytest
import torch

from conftest import scalar_gate_by_default, tiny_llama_teacher, tiny_tokenizer
from delta_attention.scripts import bench_speculative as bench
from test_generation import build, prompt


def tiny_models(draft_layers=2):
    models = {}
    for layout in ("hybrid", "all_delta"):
        model = build(layout)
        models[layout] = (model, bench.early_exit_draft(model, draft_layers), f"tiny {layout}")
    return models


def test_early_exit_draft_is_the_targets_first_layers():
    model = build("hybrid")  # delta, full, sliding, delta
    draft = bench.early_exit_draft(model, 3)
    assert draft.config.layer_types == model.config.layer_types[:3]
    ours = {id(p) for p in model.parameters()}
    assert all(id(p) in ours for p in draft.parameters())  # shared, nothing copied
    assert not any(t.is_meta for t in [*draft.parameters(), *draft.buffers()])
    ids = prompt(length=5)  # within the sliding window (6): every softmax layer is plainly causal
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        positions = model.model.rotary_emb(hidden, torch.arange(5)[None])
        for layer in model.model.layers[:3]:  # the target's first three layers by hand (no mask: causal)
            hidden = layer(hidden, position_embeddings=positions, attention_mask=None)
        expected = model.lm_head(model.model.norm(hidden))
        got = draft(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"--draft_layers \(4\) must be fewer than the target's 4 layers"):
        bench.early_exit_draft(model, 4)


def test_speculative_benchmark_runs_end_to_end(tmp_path):
    tokenizer = tiny_tokenizer()
    texts = [" ".join(f"w{(7 * i + j * j) % 90}" for j in range(200)) for i in range(3)]
    options = bench.SpeculativeOptions(passages=2, passage_tokens=24, new_tokens=10, document_tokens=48,
                                       answer_tokens=3, draft_layers=2, draft_tokens=4, lookup_tokens=4)
    results = bench.measure(tiny_models(), tokenizer, texts, options, tmp_path, log=lambda *_: None)
    report = {"environment": {"threads": torch.get_num_threads()}, "options": dataclasses.asdict(options),
              "command": "delta-attention bench-speculative", "models": results}
    bench.write_report(report, tmp_path, log=lambda *_: None)

    for name, result in results.items():
        rows = {(r["task"], r["method"]): r for r in result["generation"]}
        assert set(rows) == {(t, m) for t in ("grounded", "continuation") for m in bench.METHODS}
        for (task, method), row in rows.items():
            assert "error" not in row, f"{name} {task} {method}: {row.get('error')}"
            assert row["prompts"] == 2 and row["new_tokens"] == 20 and row["tokens_per_second"] > 0
            # after the first step: greedy's first step brings one token per prompt, a drafting method's one or more
            assert row["decode_tokens"] == 18 if method == "greedy" else 0 <= row["decode_tokens"] <= 18
            assert 0 < row["decode_seconds"] < row["seconds"]
            if row["decode_tokens"]:
                assert row["decode_tokens_per_second"] == pytest.approx(row["decode_tokens"] / row["decode_seconds"])
                assert row["decode_speedup"] == pytest.approx(row["decode_tokens_per_second"] / rows[(
                    task, "greedy")]["decode_tokens_per_second"])
            if method != "greedy":  # token for token the greedy output, from real drafts
                assert row["identical"] == 2, f"{name} {task} {method}"
                assert 0 <= row["accepted"] <= row["drafted"] and row["steps"] >= 1
                assert row["tokens_per_step"] == pytest.approx(20 / row["steps"])
                assert row["speedup"] == pytest.approx(row["tokens_per_second"] / rows[(task, "greedy")][
                    "tokens_per_second"])
        document = result["document"]
        assert document["document_tokens"] == 48 and document["same_answer"]
        assert document["state_bytes"] > 0 and document["speedup"] > 0
    assert not list(tmp_path.glob("*.state.safetensors"))  # the states are removed after the measurement

    written = json.loads((tmp_path / "speculative.json").read_text())
    assert written["models"].keys() == results.keys()
    table = (tmp_path / "speculative.md").read_text()
    header = ("| model | task | method | tokens/s | vs greedy | after the first step: tokens/s | vs greedy | acceptance "
              "| tokens per step | identical to greedy | copied |")
    assert header in table
    for name, result in results.items():
        for row in result["generation"]:
            assert ("copied" in row) == (row["method"] == "greedy") and 0 <= row.get("copied", 0) <= 1
    assert "| hybrid | grounded | prompt lookup |" in table and "| all_delta | 48 |" in table
    assert "prompt lookup on the grounded task" in table and "first token from the saved 48-token state" in table
    assert (tmp_path / "speculative.png").stat().st_size > 0


def test_the_teacher_is_measured_as_the_peer(tmp_path):
    """`--layouts ...,teacher`: the source model (here a tiny Llama) runs greedy and prompt lookup through
    transformers' own decoding, identical outputs; no assistant, no saved state; reported as the peer, not a target."""
    teacher = tiny_llama_teacher().eval()
    teacher.generation_config.pad_token_id = 0
    tokenizer = tiny_tokenizer()
    texts = [" ".join(f"w{(5 * i + j) % 90}" for j in range(200)) for i in range(3)]
    options = bench.SpeculativeOptions(passages=2, passage_tokens=24, new_tokens=8, document_tokens=48,
                                       lookup_tokens=4)
    results = bench.measure({"teacher": (teacher, None, "tiny llama")}, tokenizer, texts, options, tmp_path,
                            log=lambda *_: None)
    rows = {(r["task"], r["method"]): r for r in results["teacher"]["generation"]}
    assert set(rows) == {(t, m) for t in ("grounded", "continuation") for m in ("greedy", "prompt lookup")}
    assert all(rows[(t, "prompt lookup")]["identical"] == 2 for t in ("grounded", "continuation"))
    assert "document" not in results["teacher"] and results["teacher"]["softmax_layers"] == 2
    report = {"environment": {"threads": 1}, "options": dataclasses.asdict(options), "command": "", "models": results}
    checks = bench.target_checks(report)
    assert len(checks) == 2 and all(c.startswith("- (peer) teacher: prompt lookup on the ") for c in checks)
    with pytest.raises(ValueError, match=r"^--layouts must be a comma-separated subset of hybrid, all-delta, teacher"):
        bench.run_speculative(bench.SpeculativeOptions(layouts="hybrid,llama", output_dir=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()


def test_a_converted_model_is_reused_only_while_convert_s_options_are_unchanged(folders, tmp_path, monkeypatch):
    """`models/LAYOUT` in the output folder is reused by a rerun, and converted again (never reused) once it was made
    with options other than today's, as after `convert`'s default gate changed."""
    import delta_attention.conversion.data.assets as assets

    monkeypatch.setattr(assets, "smollm2_gguf_path", lambda: folders / "teacher")  # the tiny teacher stands in
    logs = []
    folder = bench._model_folder("all-delta", bench.SpeculativeOptions(), tmp_path, log=logs.append)
    config = json.loads((folder / "config.json").read_text())
    assert (config["linear_gate"], config["linear_log_decay_floor"]) == ("channel", -3.5)
    written = (folder / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    assert bench._model_folder("all-delta", bench.SpeculativeOptions(), tmp_path, log=logs.append) == folder
    assert logs == [] and (folder / "model.safetensors").stat().st_mtime_ns == written  # reused as it is

    scalar_gate_by_default(monkeypatch)
    assert bench._model_folder("all-delta", bench.SpeculativeOptions(), tmp_path, log=logs.append) == folder
    assert logs[0] == (f"{folder} was converted with other options (gate 'channel' there, 'scalar' now; "
                       "log_decay_floor -3.5 there, None now): converting it again")
    config = json.loads((folder / "config.json").read_text())
    assert (config["linear_gate"], config.get("linear_log_decay_floor")) == ("scalar", None)


def test_bad_options_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^--tasks must be a comma-separated subset of"):
        bench.SpeculativeOptions(tasks="grounded,quiz").validate()
    with pytest.raises(ValueError, match=r"^--document_tokens \(5000\) must be a multiple of 4096"):
        bench.SpeculativeOptions(document_tokens=5000).validate()
    with pytest.raises(ValueError, match=r"^--new_tokens must be >= 1, got 0$"):
        bench.SpeculativeOptions(new_tokens=0).validate()


def test_copied_share_counts_answer_tokens_in_runs_found_in_the_prompt():
    prompt = list(range(20))
    # tokens 3..10 (8 in a row) are in the prompt; then a loop of 7s; then 12..18 (7 in a row: one short of a run)
    answer = list(range(3, 11)) + [7] * 4 + list(range(12, 19))
    assert bench.copied_share(answer, prompt) == 8 / 19
    assert bench.copied_share(answer, prompt, run=7) == 15 / 19
    assert bench.copied_share(list(range(2, 20)), prompt) == 1.0  # overlapping runs cover each token once
    assert bench.copied_share([], prompt) == 0.0 and bench.copied_share([1, 2], prompt) == 0.0
