"""Initialisation recipes of a converted model's new parameters (the `--init` choices).

`init_new_parameters` sets what the source lacks to the `copy` init (docs/design.md, 4. Conversion,
Initialisation):

* the short conv passes the current token through unchanged (last tap 1, no activation after it);
* the output gate is `SiLU(g_proj x + 1.28)` with `g_proj` weights of std 0.002, i.e. about 1 at the start;
* beta starts at 0.5 and the decay half-lives are spread log-uniformly over the states (1 to 256 tokens; one
  state per head, or per KV head with a GQA-shared state);
* the output RMSNorm weight is ones until `set_output_norm` gives it the per-channel RMS of the teacher's
  attention output (before `o_proj`), the decisive statistic.

The `calibrated` init replaces the decay and beta by values read off the teacher's attention
(`decay_from_distance`, `beta_from_entropy`) and rescales each head's output (`scale_output_norm`). The maps
from a wanted decay or beta to the layer's parameters belong to the layer (`DeltaAttention.set_decay_at_rest`,
`set_beta_at_rest`).
"""

from __future__ import annotations

import math

import torch

from delta_attention.modeling.modeling_delta import DeltaAttention

from .weight_mapping import copy_tensor

GATE_BIAS = 1.28  # SiLU(1.28) ~= 1.0: the output gate starts open
GATE_STD = 0.002
NEW_WEIGHT_STD = 0.002
COPY_BETA = 0.5
COPY_HALF_LIFE_RANGE = (1.0, 256.0)


def copy_half_lives(num_heads: int) -> torch.Tensor:
    low, high = COPY_HALF_LIFE_RANGE
    if num_heads == 1:
        return torch.tensor([math.sqrt(low * high)])
    return torch.logspace(math.log10(low), math.log10(high), num_heads)


def init_new_parameters(attn, generator: torch.Generator | None = None) -> None:
    """The `copy` init of every parameter a delta layer has and softmax attention lacks (see module doc)."""

    def normal_(tensor, std):
        with torch.no_grad():
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32).mul_(std).to(tensor.dtype))

    attn.reset_conv_to_identity()
    with torch.no_grad():
        normal_(attn.b_proj.weight, NEW_WEIGHT_STD)
        if attn.gate != "none":
            normal_(attn.a_proj.weight, NEW_WEIGHT_STD)
            if attn.gate == "channel":
                normal_(attn.a_up_proj.weight, NEW_WEIGHT_STD)
        if hasattr(attn, "g_proj"):
            normal_(attn.g_proj.weight, GATE_STD)
            attn.g_proj.bias.fill_(GATE_BIAS)
        attn.o_norm.weight.fill_(1.0)
    attn.set_beta_at_rest(torch.full((attn.num_state_heads,), COPY_BETA))
    attn.set_decay_at_rest(0.5 ** (1.0 / copy_half_lives(attn.num_state_heads)))


def set_output_norm(attn, channel_rms: torch.Tensor) -> None:
    """Output RMSNorm weight = per-channel RMS of the teacher's attention output before `o_proj` (`[H * V]`)."""
    if channel_rms.numel() != attn.o_norm.weight.numel():
        raise ValueError(f"expected {attn.o_norm.weight.numel()} channel RMS values, got {channel_rms.numel()}")
    copy_tensor(attn.o_norm.weight, channel_rms.reshape(-1).float())


def scale_output_norm(attn, head_scale: torch.Tensor) -> None:
    """Multiply each head's output RMSNorm weight by its scale (`[H]`)."""
    with torch.no_grad():
        weight = attn.o_norm.weight.view(attn.num_heads, attn.value_head_dim)
        weight.mul_(head_scale.to(weight.dtype)[:, None])


def decay_from_distance(mean_distance: torch.Tensor) -> torch.Tensor:
    """Decay whose geometric weights a^k have the teacher's mean attention distance d: a = d / (1 + d)."""
    d = mean_distance.float().clamp(min=0.0)
    return (d / (1.0 + d)).clamp(*DeltaAttention.DECAY_AT_REST_RANGE)


def beta_from_entropy(entropy: torch.Tensor, low: float = 0.1, high: float = 0.95) -> torch.Tensor:
    """Beta from attention entropy: a sharp head (few attended tokens) overwrites, a broad one accumulates.

    With `n = exp(entropy)` the effective number of attended tokens, beta = 1 / sqrt(n), clamped to
    [low, high].
    """
    n_eff = entropy.float().exp()
    return n_eff.rsqrt().clamp(low, high)


__all__ = [
    "GATE_BIAS",
    "GATE_STD",
    "beta_from_entropy",
    "copy_half_lives",
    "decay_from_distance",
    "init_new_parameters",
    "scale_output_norm",
    "set_output_norm",
]
