"""DeltaAttention owns its parametrisation: new parameters, decay and beta at rest and their inverses."""

import pytest
import torch

from conftest import tiny_delta_model
from delta_attention.modeling.modeling_delta import DeltaAttention


def delta_layer(gate="scalar", **overrides) -> DeltaAttention:
    model = tiny_delta_model(num_hidden_layers=1, layer_types=["linear_attention"], linear_gate=gate, **overrides)
    return model.model.layers[0].self_attn


OPTIONS = [{}, {"use_qk_norm": True}, {"linear_output_gate": False, "linear_conv_kernel_size": 0}]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_new_parameters_are_all_but_the_attention_projections(gate, options):
    attn = delta_layer(gate, **options)
    new = {name for name, p in attn.named_parameters() if any(p is q for q in attn.new_parameters())}
    copied = {name for name, _ in attn.named_parameters()} - new
    assert {name.split(".")[0] for name in copied} <= set(DeltaAttention.COPIED_FROM_ATTENTION)
    assert all(name.split(".")[0] not in DeltaAttention.COPIED_FROM_ATTENTION for name in new)
    assert {"b_proj.weight", "b_proj.bias", "o_norm.weight"} <= new
    assert ("A_log" in new) == (gate != "none") and ("a_up_proj.weight" in new) == (gate == "channel")
    assert ("conv1d.weight" in new) == (options.get("linear_conv_kernel_size", 4) > 0)
    assert ("g_proj.weight" in new) == options.get("linear_output_gate", True)
    assert ("q_norm.weight" in copied) == options.get("use_qk_norm", False)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_decay_at_rest_round_trip(gate):
    attn = delta_layer(gate)
    decay = torch.tensor([0.5, 0.9, 0.99, 0.9999])
    attn.set_decay_at_rest(decay)
    assert torch.allclose(attn.decay_at_rest(), decay, rtol=0, atol=1e-6)
    assert (attn.A_log == 0).all()
    if gate == "channel":  # every channel of a head gets the head's decay
        assert (attn.dt_bias.view(4, -1) == attn.dt_bias.view(4, -1)[:, :1]).all()
    attn.set_decay_at_rest(torch.tensor([0.1, 0.6, 0.7, 1.0]))  # clamped to DECAY_AT_REST_RANGE
    assert torch.allclose(attn.decay_at_rest(), torch.tensor([0.5, 0.6, 0.7, 0.9999]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_decay_at_rest_is_the_forward_decay_at_zero_input(gate):
    attn = delta_layer(gate)  # the random Mamba2 init: A_log != 0
    with torch.no_grad():
        log_decay = attn._log_decay(torch.zeros(1, 1, attn.config.hidden_size))[0, 0]  # [H] or [H, K]
    expected = (log_decay.mean(-1) if gate == "channel" else log_decay).exp()
    assert torch.allclose(attn.decay_at_rest(), expected)


def test_no_gate_has_no_decay():
    attn = delta_layer("none")
    assert attn.decay_at_rest() is None
    attn.set_decay_at_rest(torch.full((4,), 0.9))  # a no-op, as there is nothing to set


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_beta_at_rest_round_trip(neg_eigval):
    attn = delta_layer(linear_allow_neg_eigval=neg_eigval)
    top = 2.0 if neg_eigval else 1.0
    beta = torch.tensor([0.1, 0.5, 0.7, 0.9]) * top
    attn.set_beta_at_rest(beta)
    assert torch.allclose(attn.beta_at_rest(), beta, atol=1e-6)
    with torch.no_grad():
        forward_beta = attn._beta(torch.zeros(1, 1, attn.config.hidden_size))[0, 0]
    assert torch.allclose(forward_beta, beta, atol=1e-6)
    attn.set_beta_at_rest(torch.tensor([0.0, 1.0, 2.0, 0.5]) * top)  # clamped to BETA_AT_REST_RANGE before the logit
    expected = torch.tensor([0.0, 1.0, 2.0, 0.5]).clamp(*DeltaAttention.BETA_AT_REST_RANGE) * top
    assert torch.allclose(attn.beta_at_rest(), expected, atol=1e-6)


@pytest.mark.parametrize("conv", [4, 0])
def test_reset_conv_to_identity(conv):
    attn = delta_layer(linear_conv_kernel_size=conv)
    if conv:
        with torch.no_grad():
            attn.conv1d.weight.normal_()
    attn.reset_conv_to_identity()
    if conv:
        expected = torch.zeros_like(attn.conv1d.weight)
        expected[..., -1] = 1.0
        assert torch.equal(attn.conv1d.weight, expected)
        x = torch.randn(2, 7, attn.conv1d.weight.shape[0])
        assert torch.allclose(attn._short_conv(x, None), attn.conv_act(x), atol=1e-6)  # a pass-through


def test_fresh_model_starts_with_an_identity_conv():
    attn = delta_layer()
    expected = torch.zeros_like(attn.conv1d.weight)
    expected[..., -1] = 1.0
    assert torch.equal(attn.conv1d.weight, expected)
