"""DeltaConfig: defaults derived from the Llama-family fields, and clear errors for invalid values."""

import pytest
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM

from delta_attention import DeltaConfig, DeltaForCausalLM

LLAMA_FIELDS = dict(
    vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)


def test_llama_fields_alone_build_a_working_model():
    config = AutoConfig.for_model(
        "delta", **LLAMA_FIELDS, layer_types=["full_attention", "linear_attention", "linear_attention", "linear_attention"]
    )
    assert isinstance(config, DeltaConfig)
    assert config.linear_num_heads == 4
    assert config.linear_key_head_dim == config.linear_value_head_dim == 16
    assert config.linear_gate == "scalar" and config.linear_output_gate_activation == "silu"
    assert config.linear_gate_low_rank_dim == 16 and config.linear_conv_kernel_size == 4
    assert config.attention_out_bias is False and config.rope_parameters["rope_theta"] == 10000.0
    assert set(config.auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, DeltaForCausalLM)
    assert model(__import__("torch").tensor([[1, 2, 3]])).logits.shape == (1, 3, 101)


def test_defaults_every_layer_delta_and_kda_uses_sigmoid_gate():
    config = DeltaConfig(**LLAMA_FIELDS, linear_gate="channel")
    assert config.layer_types == ["linear_attention"] * 4
    assert config.linear_output_gate_activation == "sigmoid"
    assert config.num_delta_layers == 4


def test_round_trip_through_dict():
    config = DeltaConfig(**LLAMA_FIELDS, linear_gate="none", linear_conv_kernel_size=0, sliding_window=8,
                         layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"])
    again = DeltaConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(layer_types=["linear_attention", "mamba2", "full_attention", "linear_attention"]),
         r"`layer_types` contains unknown layer type\(s\) \['mamba2'\]; allowed values are "
         r"\['linear_attention', 'full_attention', 'sliding_attention'\]"),
        (dict(layer_types=["linear_attention"] * 3),
         r"`layer_types` has 3 entries but `num_hidden_layers` is 4"),
        (dict(num_key_value_heads=3),
         r"`num_attention_heads` \(4\) must be divisible by `num_key_value_heads` \(3\)"),
        (dict(linear_log_decay_floor=0.0), r"`linear_log_decay_floor` must be a negative number .*got 0.0"),
        (dict(linear_gate="mamba"),
         r"`linear_gate` must be one of \['none', 'scalar', 'channel'\].*got 'mamba'"),
        (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]),
         r"`sliding_window` must be a positive int"),
        (dict(linear_conv_kernel_size=-1), r"`linear_conv_kernel_size` must be >= 0"),
        (dict(linear_conv_activation="gelu"), r"`linear_conv_activation` must be one of \[None, 'silu'\]"),
        (dict(linear_output_gate_activation="tanh"), r"`linear_output_gate_activation` must be one of"),
        (dict(linear_chunk_size=0), r"`linear_chunk_size` must be a positive int"),
    ],
)
def test_invalid_values_fail_at_construction_naming_the_field(overrides, message):
    with pytest.raises(StrictDataclassError, match=message):
        DeltaConfig(**{**LLAMA_FIELDS, **overrides})


def test_wrong_types_are_rejected_by_strict_validation():
    with pytest.raises(StrictDataclassError, match="linear_chunk_size"):
        DeltaConfig(**LLAMA_FIELDS, linear_chunk_size="64")
