"""Stage 3 of `distill` (long-context distillation) on tiny models: the chunked loss equals the whole-logits loss,
gradient checkpointing changes no gradient, a `--stages 1,2,3` run records stage 3, a run killed in stage 3
resumes to the same weights, and bad stage-3 options fail with one line."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

import delta_attention.conversion.training.distill as pipeline
from delta_attention.conversion.training.distill import run_distill
from delta_attention.conversion.training.lora import LoraOptions, lora_config
from delta_attention.conversion.training.loop import _enable_activation_checkpointing
from delta_attention.conversion.training.metrics import read_metrics
from delta_attention.conversion.training.objectives import (
    ChunkedLogitDistillation,
    LogitDistillation,
    add_lora,
    chunked_distillation_loss,
    distillation_kl,
)
from conftest import Killed, training_killed_at
from test_distill import options

#: a short recipe: stages 1 and 2 of a few steps, then stage 3 on 128-token blocks (6 steps of 2 blocks)
SHORT = dict(stage1_tokens=2 * 8 * 32, stage2_tokens=4 * 8 * 32, stage3_seq_len=128, stage3_batch_size=2,
             stage3_tokens=6 * 2 * 128, stage3_logit_chunk=48, checkpoint_every_tokens=2 * 8 * 32,
             stages="1,2,3", lora_r=4)


@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_equals_the_whole_logits_loss_with_its_gradients(masked):
    generator = torch.Generator().manual_seed(0)
    student_head, teacher_head = nn.Linear(16, 50, bias=False), nn.Linear(16, 50, bias=False)
    student_hidden = torch.randn(2, 37, 16, generator=generator, requires_grad=True)
    teacher_hidden = torch.randn(2, 37, 16, generator=generator)
    next_tokens = torch.randint(0, 50, (2, 37), generator=generator)
    next_tokens[:, -1] = -100  # the last position predicts nothing
    counted = torch.ones(2, 37, dtype=torch.bool)
    if masked:  # chat rows: only the positions that predict an answer token count
        counted = torch.rand(2, 37, generator=generator) < 0.6
        counted[:, -1] = False
        next_tokens[~counted] = -100
    widest = []
    handle = student_head.register_forward_hook(lambda module, args, output: widest.append(output.shape[0]))

    kl, ce = chunked_distillation_loss(student_hidden, teacher_hidden, student_head, teacher_head, 2.0, 8,
                                       next_tokens, counted if masked else None)
    (kl + 0.5 * ce).backward()
    chunked = (student_hidden.grad.clone(), student_head.weight.grad.clone())
    handle.remove()
    assert teacher_head.weight.grad is None  # the teacher never trains
    rows = int(counted.sum()) if masked else 2 * 37  # the positions scored, over the batch
    assert max(widest) == 8  # never more than one chunk of logits
    assert len(widest) == -(-rows // 8)  # each chunk made once: its gradient comes from the softmaxes, not a rerun

    student_hidden.grad, student_head.weight.grad = None, None
    logits = student_head(student_hidden)
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    reference_kl = distillation_kl(logits[counted], teacher_logits[counted], 2.0)
    scored = next_tokens != -100
    reference_ce = F.cross_entropy(logits[scored], next_tokens[scored])
    (reference_kl + 0.5 * reference_ce).backward()
    assert kl.item() == pytest.approx(reference_kl.item(), rel=1e-6)
    assert ce.item() == pytest.approx(reference_ce.item(), rel=1e-6)
    assert torch.allclose(chunked[0], student_hidden.grad, atol=1e-7, rtol=1e-5)
    assert torch.allclose(chunked[1], student_head.weight.grad, atol=1e-7, rtol=1e-5)


def test_stage_3_objective_equals_stage_2_and_checkpointing_keeps_every_gradient(folders):  # noqa: F811
    teacher = AutoModelForCausalLM.from_pretrained(folders / "teacher").eval()
    student = AutoModelForCausalLM.from_pretrained(folders / "student")
    lora = LoraOptions(lora_r=4).resolved("q_proj,k_proj,v_proj,o_proj", 0.0)
    peft_model, _ = add_lora(student, lora_config(lora))
    with torch.no_grad():  # LoRA B starts at zero, which would leave every LoRA A gradient zero
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    ids = torch.randint(3, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(40), torch.arange(24)]), torch.arange(64)])  # 3 documents

    def loss_and_gradients(objective):
        peft_model.zero_grad()
        loss, metrics = objective.train()(ids, positions)
        loss.backward()
        return loss.item(), metrics, {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.grad is not None}

    whole = loss_and_gradients(LogitDistillation(teacher, peft_model, 2.0, 0.3))
    chunked_objective = ChunkedLogitDistillation(teacher, peft_model, 2.0, 0.3, chunk_tokens=16)
    teacher_widths, delta_calls = [], []
    handles = [teacher.lm_head.register_forward_hook(lambda m, a, out: teacher_widths.append(out.shape[0])),
               student.model.layers[1].self_attn.register_forward_hook(lambda *_: delta_calls.append(1))]
    chunked = loss_and_gradients(chunked_objective)
    calls = len(delta_calls)
    recomputed = _enable_activation_checkpointing(chunked_objective, "stage 3", print)
    checkpointed = loss_and_gradients(chunked_objective)
    for handle in handles:
        handle.remove()
    assert recomputed == [student] and student.model.gradient_checkpointing
    assert calls >= 1 and len(delta_calls) == 3 * calls  # the checkpointed step ran the layer again in its backward
    assert max(teacher_widths) == 16  # the teacher's logits came 16 positions (over the batch) at a time

    assert chunked[0] == pytest.approx(whole[0], rel=1e-5)
    assert chunked[1]["ce"] == pytest.approx(whole[1]["ce"], rel=1e-5)
    assert checkpointed[0] == pytest.approx(chunked[0], rel=1e-6)
    assert whole[2].keys() == chunked[2].keys() == checkpointed[2].keys() and len(whole[2]) > 10
    for name in whole[2]:
        assert torch.allclose(chunked[2][name], whole[2][name], atol=1e-6, rtol=1e-4), name
        assert torch.allclose(checkpointed[2][name], chunked[2][name], atol=1e-7, rtol=1e-5), name


@pytest.fixture(scope="module")
def straight(folders, tmp_path_factory):  # noqa: F811
    """One uninterrupted `--stages 1,2,3` run (gradient checkpointing asked for every stage)."""
    out = tmp_path_factory.mktemp("long") / "straight"
    results = run_distill(*options(folders, out, eval_tokens=256, gradient_checkpointing=True, **SHORT))
    return out, results


def test_stages_1_2_3_record_stage_3_in_metrics_results_and_card(straight):
    out, results = straight
    assert len(read_metrics(out / "stage3" / "metrics.jsonl")) == 6
    state = json.loads((out / "stage3" / "checkpoints" / "step-0000006" / "state.json").read_text())
    assert state["run"]["seq_len"] == 128 and state["run"]["batch_size"] == 2 and state["tokens"] == 6 * 2 * 128
    stage3 = results["stage3"]
    assert (stage3["tokens"], stage3["seq_len"], stage3["packing"], stage3["gradient_checkpointing"]) == (
        1536, 128, "plain", True)
    assert stage3["heldout_ppl"] is not None and json.loads((out / "results.json").read_text())["stage3"] == stage3
    card = (out / "model" / "README.md").read_text()
    assert "| 3: long-context distillation | 1,536 |" in card and "on 128-token blocks (plain packing)" in card
    assert "| after stage 3 (1,536 tokens) |" in card and "| after stage 2 (1,024 tokens) |" in card
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "DeltaForCausalLM" and not any("lora" in n for n, _ in model.named_parameters())
    assert (out / "metrics.png").exists()


def test_killed_during_stage_3_and_resumed_gives_the_same_weights(folders, straight, tmp_path, monkeypatch):  # noqa: F811
    original = pipeline.run_training

    killed_at_step_5_of_stage_3 = training_killed_at(original, 3, 5)

    run = options(folders, tmp_path / "resumed", eval_tokens=256, gradient_checkpointing=True, **SHORT)
    monkeypatch.setattr(pipeline, "run_training", killed_at_step_5_of_stage_3)
    with pytest.raises(Killed):
        run_distill(*run)
    monkeypatch.setattr(pipeline, "run_training", original)
    assert not (tmp_path / "resumed" / "model").exists()
    assert (tmp_path / "resumed" / "stage3" / "checkpoints" / "latest").read_text() == "step-0000004"
    run[2].resume = True
    run_distill(*run)
    a = AutoModelForCausalLM.from_pretrained(straight[0] / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "model").state_dict()
    before = AutoModelForCausalLM.from_pretrained(folders / "student").state_dict()
    assert a.keys() == b.keys()
    assert max((a[name] - before[name]).abs().max().item() for name in a) > 1e-3
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name
    straight_losses = [r["loss"] for r in read_metrics(straight[0] / "stage3" / "metrics.jsonl")]
    resumed_losses = [r["loss"] for r in read_metrics(tmp_path / "resumed" / "stage3" / "metrics.jsonl")]
    assert resumed_losses == pytest.approx(straight_losses, rel=1e-5)


def test_stage_1_with_gradient_checkpointing_says_there_is_nothing_to_recompute(folders, tmp_path, capsys):  # noqa: F811
    run_distill(*options(folders, tmp_path / "run", stages="1", stage1_tokens=8 * 32, eval_tokens=0,
                         gradient_checkpointing=True))
    assert "stage 1 (attention transfer): --gradient_checkpointing has nothing to recompute" in capsys.readouterr().out


@pytest.mark.parametrize("override, message", [
    ({"stages": "1,2,4"}, "--stages must name stages 1 and/or 2 and/or 3 (e.g. --stages 1,2 or --stages 1,2,3), "
                          "got '1,2,4'"),
    ({"stage3_seq_len": 1}, "--stage3_seq_len must be at least 2, got 1"),
    ({"stage3_packing": "tight"}, "--stage3_packing must be one of boundary, plain, got 'tight'"),
    ({"stage3_logit_chunk": 0}, "--stage3_logit_chunk must be >= 1, got 0"),
    ({"stage3_batch_size": 3, "gradient_accumulation_steps": 2, "batch_size": 8},
     "--stage3_batch_size (3) must be a multiple of --gradient_accumulation_steps (2)"),
])
def test_bad_stage_3_options_fail_with_one_line(folders, tmp_path, override, message):  # noqa: F811
    with pytest.raises(ValueError) as error:
        run_distill(*options(folders, tmp_path / "run", **{"stages": "1,2,3", **override}))
    assert str(error.value) == message
    assert not (tmp_path / "run").exists()


def test_too_little_text_for_one_stage_3_block_names_the_flag(folders, tmp_path, capsys):  # noqa: F811
    with pytest.raises(ValueError, match=r"^stage 3: .*not enough text for one block of 100000 tokens; lower "
                                         r"--stage3_seq_len or give --dataset more text$"):
        run_distill(*options(folders, tmp_path / "run", stages="3", stage3_seq_len=100_000))
    assert "--stage3_seq_len 100000 is longer than the teacher's max_position_embeddings (256)" in (
        capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
