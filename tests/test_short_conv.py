"""The short conv's shifted multiply-adds (`causal_conv`) against `F.conv1d` (`causal_conv_reference`): outputs and
both gradients, with cached positions before the new ones, fewer positions than taps, 16-bit inputs and autocast."""

import pytest
import torch

from delta_attention.modeling.short_conv import causal_conv, causal_conv_reference


def _inputs(batch, length, channels, width, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, length, channels, generator=generator).to(dtype)
    weight = torch.randn(channels, width, generator=generator) / width
    return inputs, weight


@pytest.mark.parametrize("length, new_tokens, width", [(37, 37, 4), (40, 7, 4), (3, 3, 4), (6, 1, 4), (33, 30, 2),
                                                       (12, 12, 1)])
def test_matches_conv1d_in_float32_with_both_gradients(length, new_tokens, width):
    inputs, weight = _inputs(2, length, 24, width)
    inputs_fast, weight_fast = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    inputs_ref, weight_ref = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    out = causal_conv(inputs_fast, weight_fast, new_tokens)
    expected = causal_conv_reference(inputs_ref, weight_ref, new_tokens)
    assert out.shape == expected.shape == (2, new_tokens, 24)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(inputs_fast.grad, inputs_ref.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight_fast.grad, weight_ref.grad, atol=1e-4, rtol=1e-5)


def test_strided_inputs_as_the_cache_returns_them():
    # the cache hands the conv [B, D, P + T] (cached window, then the new inputs): the layer passes its transpose
    inputs, weight = _inputs(1, 20, 16, 4)
    channels_first = inputs.transpose(1, 2).contiguous()
    out = causal_conv(channels_first.transpose(1, 2), weight, 17)
    torch.testing.assert_close(out, causal_conv_reference(inputs, weight, 17), atol=1e-6, rtol=1e-6)


def test_bf16_inputs_sum_in_float32_and_autocast_keeps_bf16():
    inputs, weight = _inputs(2, 50, 32, 4, dtype=torch.bfloat16)
    exact = causal_conv_reference(inputs.float(), weight, 50)  # the bf16 inputs' exact conv
    out = causal_conv(inputs, weight)
    assert out.dtype == torch.bfloat16
    # one bf16 rounding of the float32 sum (2^-8 relative), nothing accumulated in bf16
    torch.testing.assert_close(out.float(), exact, atol=1e-6, rtol=2**-8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert causal_conv(inputs, weight).dtype == torch.bfloat16
        assert causal_conv(inputs.float(), weight).dtype == torch.float32


def test_bf16_gradients_match_the_float32_reference_to_bf16_rounding():
    inputs, weight = _inputs(2, 64, 32, 4, dtype=torch.bfloat16)
    grad = torch.randn(2, 60, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    inputs_fast, weight_fast = inputs.clone().requires_grad_(), weight.clone().requires_grad_()
    causal_conv(inputs_fast, weight_fast, 60).backward(grad)
    inputs_ref, weight_ref = inputs.float().requires_grad_(), weight.clone().requires_grad_()
    causal_conv_reference(inputs_ref, weight_ref, 60).backward(grad.float())
    assert inputs_fast.grad.dtype == torch.bfloat16 and weight_fast.grad.dtype == torch.float32
    # the input gradient: one bf16 rounding of a float32 sum; the weight's: float32 throughout
    torch.testing.assert_close(inputs_fast.grad.float(), inputs_ref.grad, atol=1e-6, rtol=2**-8)
    torch.testing.assert_close(weight_fast.grad, weight_ref.grad, atol=1e-5, rtol=1e-5)


def test_new_tokens_beyond_the_inputs_is_refused():
    inputs, weight = _inputs(1, 5, 4, 4)
    with pytest.raises(ValueError, match="between 0 and the 5 input positions, got 6"):
        causal_conv(inputs, weight, 6)


def test_the_model_trains_through_it_as_through_conv1d(monkeypatch):
    # a DeltaForCausalLM's loss and conv-weight gradients are those of the same model with the F.conv1d form
    from delta_attention import DeltaConfig, DeltaForCausalLM
    from delta_attention.modeling import modeling_delta

    config = DeltaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    torch.manual_seed(0)
    model = DeltaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(3))

    def loss_and_conv_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [layer.self_attn.conv1d.weight.grad.clone() for layer in model.model.layers]

    loss, grads = loss_and_conv_grads()
    monkeypatch.setattr(modeling_delta, "causal_conv", lambda inputs, weight, new_tokens=None: causal_conv_reference(
        inputs, weight, inputs.shape[1] if new_tokens is None else new_tokens))
    expected_loss, expected_grads = loss_and_conv_grads()
    torch.testing.assert_close(loss, expected_loss, atol=1e-6, rtol=1e-6)
    for grad, expected in zip(grads, expected_grads):
        assert expected.abs().sum() > 0
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)
