"""Frozen linear weights cast once for the training autocast (`conversion/training/frozen_casts.py`): the same
products and gradients bit for bit, the float weights back in place after the block, copies made again when a
weight changes."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from torch import nn

from conftest import tiny_delta_model, tiny_llama_teacher
from delta_attention.conversion.training.frozen_casts import FrozenLinearCasts
from delta_attention.conversion.training.objectives import (
    AttentionTransfer,
    LogitDistillation,
    add_lora,
    delta_layer_indices,
    freeze_all,
    stage1_parameters,
)

BF16 = torch.bfloat16


def frozen_and_trained_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4, bias=False))
    model[0].requires_grad_(False)
    return model


def test_inside_the_block_frozen_weights_are_cast_copies_and_trained_ones_are_untouched():
    model = frozen_and_trained_layers()
    frozen_weight, frozen_bias, trained_weight = model[0].weight, model[0].bias, model[2].weight
    casts = FrozenLinearCasts()
    with torch.autocast("cpu", dtype=BF16), casts.cast_in(model):
        assert model[0].weight.dtype == BF16 and model[0].bias.dtype == BF16
        assert torch.equal(model[0].weight, frozen_weight.to(BF16))
        assert model[2].weight is trained_weight  # trains: autocast casts it (and keeps that cast itself)
    assert model[0].weight is frozen_weight and model[0].bias is frozen_bias


def test_a_layer_met_twice_is_cast_once_and_put_back():
    model = frozen_and_trained_layers()
    weight = model[0].weight
    with torch.autocast("cpu", dtype=BF16), FrozenLinearCasts().cast_in(model, model[0]):
        assert model[0].weight.dtype == BF16
    assert model[0].weight is weight


def test_without_autocast_nothing_is_swapped():
    model = frozen_and_trained_layers()
    weight = model[0].weight
    with FrozenLinearCasts().cast_in(model):
        assert model[0].weight is weight
        model(torch.randn(2, 8))  # float32 input, float32 weight: runs


def test_the_weights_are_back_after_an_error():
    model = frozen_and_trained_layers()
    weight = model[0].weight
    with pytest.raises(RuntimeError, match="boom"), torch.autocast("cpu", dtype=BF16):
        with FrozenLinearCasts().cast_in(model):
            raise RuntimeError("boom")
    assert model[0].weight is weight


def test_products_and_gradients_are_those_of_autocast():
    model = frozen_and_trained_layers()
    x = torch.randn(5, 8, requires_grad=True)

    def run(casts):
        x.grad = None
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF16), casts:
            out = model(x)
        out.float().square().sum().backward()
        return out, x.grad.clone(), model[2].weight.grad.clone()

    import contextlib

    for got, expected in zip(run(FrozenLinearCasts().cast_in(model)), run(contextlib.nullcontext())):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_copy_is_kept_between_blocks_and_made_again_when_its_weight_changes():
    model = frozen_and_trained_layers()
    casts = FrozenLinearCasts()
    with torch.autocast("cpu", dtype=BF16):
        with casts.cast_in(model):
            first = model[0].weight
        with casts.cast_in(model):
            assert model[0].weight is first  # kept: no second cast
        with torch.no_grad():
            model[0].weight.mul_(2)  # an in-place change moves the version counter
        with casts.cast_in(model):
            assert model[0].weight is not first
            assert torch.equal(model[0].weight, (2 * first.float()).to(BF16))
        model[0].weight = nn.Parameter(torch.zeros(16, 8), requires_grad=False)  # another tensor in its place
        with casts.cast_in(model):
            assert not model[0].weight.any()


def assert_same_as_autocast_alone(model, objective, autocast_alone, fewest_copies: int) -> None:
    """One step of `objective` (its frozen weights cast once) and one of `autocast_alone` (its `_forward`): the same
    loss and gradients of `model`'s trained parameters, bit for bit."""
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(2))

    def loss_and_gradients(forward):
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss, _ = forward(ids)
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_gradients(objective)
    assert len(objective._casts._copies) >= fewest_copies
    # the LM head is tied to the embeddings, which stay float32
    assert model.get_input_embeddings().weight.dtype == torch.float32
    expected_loss, expected_grads = loss_and_gradients(autocast_alone)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)


def test_stage_1_loss_and_gradients_are_the_same_bit_for_bit():
    teacher = tiny_llama_teacher(num_hidden_layers=3).eval().requires_grad_(False)
    student = tiny_delta_model(seed=1).train()
    freeze_all(student)
    layers = delta_layer_indices(student)
    for p in stage1_parameters(student, layers):
        p.requires_grad_(True)
    objective = AttentionTransfer(teacher, student, layers)
    # the teacher's and the mixers' frozen projections
    assert_same_as_autocast_alone(student, objective, lambda ids: objective._forward(ids, None), 4 * len(layers) + 1)


def stage_2_under_lora(temperature=1.0, ce_weight=0.0, chunk_tokens=16, checkpointing=False):
    """(student, LoRA model, objective) on the tiny teacher and student, LoRA on q and v."""
    teacher = tiny_llama_teacher().eval().requires_grad_(False)
    student = tiny_delta_model(seed=1).train()
    freeze_all(student)
    peft_model, _ = add_lora(student, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    if checkpointing:  # as the training loop turns it on
        student.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return student, peft_model, LogitDistillation(teacher, peft_model, temperature, ce_weight, chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [None, 16])
def test_stage_2_loss_and_gradients_under_lora_are_the_same_bit_for_bit(chunk_tokens):
    _, peft_model, objective = stage_2_under_lora(2.0, 0.5, chunk_tokens)
    assert_same_as_autocast_alone(peft_model, objective, lambda ids: objective._forward(ids, None, None), 11)
    assert any("lora_" in name for name, p in peft_model.named_parameters() if p.grad is not None)


def test_with_activation_checkpointing_the_recomputed_layers_give_the_same_gradients():
    # the backward pass recomputes each layer outside the block, where autocast casts the float32 weights again:
    # the same values, so the same gradients
    student, peft_model, objective = stage_2_under_lora(checkpointing=True)
    calls = []
    student.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: calls.append(1))
    assert_same_as_autocast_alone(peft_model, objective, lambda ids: objective._forward(ids, None, None), 11)
    assert len(calls) == 2 * 2  # each step runs the layer in the forward pass and again in the backward pass


def test_finetuning_loss_and_gradients_are_the_same_bit_for_bit():
    from peft import get_peft_model

    from delta_attention.conversion.training.finetune import _loss, _loss_with_frozen_casts

    model = get_peft_model(tiny_delta_model(seed=1).train(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    casts = FrozenLinearCasts()

    def loss_and_gradients(loss_function):
        model.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss, _ = loss_function(model, {"input_ids": ids})
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_gradients(_loss_with_frozen_casts(casts))
    assert len(casts._copies) > 10 and model.get_output_embeddings().weight.dtype == torch.float32  # put back
    expected_loss, expected_grads = loss_and_gradients(_loss)
    assert torch.equal(loss, expected_loss)
    assert grads.keys() == expected_grads.keys() and any("lora_" in n for n in grads)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)
