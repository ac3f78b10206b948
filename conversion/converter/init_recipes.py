"""Weight mapping and initialisation of a converted model (pure functions on modules and tensors).

`copy_shared_weights` copies what stays: embeddings, norms, MLPs, lm_head and the kept softmax layers.
`copy_delta_projections` gives a delta layer the source's q/o projections and its k/v projections repeated
over the GQA groups (one state per query head). `init_new_parameters` sets what the source lacks to the
`copy` init (DESIGN.md section 4):

* the short conv passes the current token through unchanged (last tap 1, no activation after it);
* the output gate is `SiLU(g_proj x + 1.28)` with `g_proj` weights of std 0.002, i.e. about 1 at the start;
* beta starts at 0.5 and the decay half-lives are spread log-uniformly over the heads (1 to 256 tokens);
* the output RMSNorm weight is ones until `set_output_norm` gives it the per-channel RMS of the teacher's
  attention output (before `o_proj`), the decisive statistic.

The `calibrated` init replaces the decay and beta by values read off the teacher's attention
(`decay_from_distance`, `beta_from_entropy`) and rescales each head's output (`scale_output_norm`).
"""

from __future__ import annotations

import math

import torch

GATE_BIAS = 1.28  # SiLU(1.28) ~= 1.0: the output gate starts open
GATE_STD = 0.002
NEW_WEIGHT_STD = 0.002
COPY_BETA = 0.5
COPY_HALF_LIFE_RANGE = (1.0, 256.0)
MIN_DECAY, MAX_DECAY = 0.5, 0.9999


def _copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def _copy_module(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    src_state = src.state_dict()
    dst_state = dst.state_dict()
    if set(src_state) != set(dst_state):
        raise ValueError(
            f"cannot copy {type(src).__name__} into {type(dst).__name__}: parameters "
            f"{sorted(set(src_state) ^ set(dst_state))} differ"
        )
    for name, tensor in src_state.items():
        if dst_state[name].shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(dst_state[name].shape)}")
        _copy_(dst_state[name], tensor)


def copy_shared_weights(source_model, target_model, kept_layers) -> None:
    """Copy embeddings, final norm, lm_head, every block's norms and MLP, and the kept attention layers."""
    src, dst = source_model.model, target_model.model
    _copy_module(dst.embed_tokens, src.embed_tokens)
    _copy_module(dst.norm, src.norm)
    if not target_model.config.tie_word_embeddings:
        _copy_module(target_model.lm_head, source_model.lm_head)
    for i, (s, d) in enumerate(zip(src.layers, dst.layers)):
        _copy_module(d.input_layernorm, s.input_layernorm)
        _copy_module(d.post_attention_layernorm, s.post_attention_layernorm)
        _copy_module(d.mlp, s.mlp)
        if i in kept_layers:
            _copy_module(d.self_attn, s.self_attn)


def repeat_kv_rows(weight: torch.Tensor, kv_heads: int, groups: int) -> torch.Tensor:
    """Rows of a k/v projection (`[kv_heads * d, ...]`) repeated so query head h reads KV head h // groups."""
    if groups == 1:
        return weight.clone()
    shape = weight.shape
    per_head = weight.reshape(kv_heads, shape[0] // kv_heads, *shape[1:])
    return per_head.repeat_interleave(groups, dim=0).reshape(shape[0] * groups, *shape[1:])


def copy_delta_projections(src_attn, dst_attn, num_heads: int, kv_heads: int) -> None:
    """q/o copied, k/v repeated over the GQA groups, biases alike, q/k RMSNorm (Qwen3) copied."""
    groups = num_heads // kv_heads
    _copy_(dst_attn.q_proj.weight, src_attn.q_proj.weight)
    _copy_(dst_attn.o_proj.weight, src_attn.o_proj.weight)
    _copy_(dst_attn.k_proj.weight, repeat_kv_rows(src_attn.k_proj.weight, kv_heads, groups))
    _copy_(dst_attn.v_proj.weight, repeat_kv_rows(src_attn.v_proj.weight, kv_heads, groups))
    for name in ("q_proj", "o_proj"):
        if getattr(dst_attn, name).bias is not None:
            _copy_(getattr(dst_attn, name).bias, getattr(src_attn, name).bias)
    for name in ("k_proj", "v_proj"):
        if getattr(dst_attn, name).bias is not None:
            _copy_(getattr(dst_attn, name).bias, repeat_kv_rows(getattr(src_attn, name).bias, kv_heads, groups))
    for name in ("q_norm", "k_norm"):
        if hasattr(dst_attn, name):
            _copy_module(getattr(dst_attn, name), getattr(src_attn, name))


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    y = y.clamp(min=1e-6)
    return y + torch.log(-torch.expm1(-y))


def set_decay(attn, decay: torch.Tensor) -> None:
    """Per-head decay factors `a` in (0, 1) (state multiplied by `a` every token) at zero input: A=1, dt_bias."""
    if attn.gate == "none":
        return
    decay = decay.float().clamp(MIN_DECAY, MAX_DECAY)
    dt = inverse_softplus(-torch.log(decay))  # softplus(dt_bias) = -log(a) with A = exp(A_log) = 1
    with torch.no_grad():
        attn.A_log.zero_()
        if attn.gate == "channel":
            dt = dt.repeat_interleave(attn.key_head_dim)
        attn.dt_bias.copy_(dt.to(attn.dt_bias.dtype))


def set_beta(attn, beta: torch.Tensor) -> None:
    """Per-head beta at zero input, through `b_proj.bias` (beta = sigmoid, or 2 sigmoid with negative eigenvalues)."""
    beta = beta.float()
    if attn.allow_neg_eigval:
        beta = beta / 2
    beta = beta.clamp(1e-3, 1 - 1e-3)
    with torch.no_grad():
        attn.b_proj.bias.copy_(torch.log(beta / (1 - beta)).to(attn.b_proj.bias.dtype))


def decay_of(attn) -> torch.Tensor | None:
    """The per-head decay factor at zero input (mean over channels for the channel gate)."""
    if attn.gate == "none":
        return None
    log_decay = -attn.A_log.detach().float().exp().repeat_interleave(
        attn.key_head_dim if attn.gate == "channel" else 1
    ) * torch.nn.functional.softplus(attn.dt_bias.detach().float())
    if attn.gate == "channel":
        log_decay = log_decay.view(attn.num_heads, attn.key_head_dim).mean(-1)
    return log_decay.exp()


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

    with torch.no_grad():
        if attn.conv_kernel_size > 0:
            weight = torch.zeros_like(attn.conv1d.weight)
            weight[..., -1] = 1.0
            attn.conv1d.weight.copy_(weight)
        normal_(attn.b_proj.weight, NEW_WEIGHT_STD)
        if attn.gate != "none":
            normal_(attn.a_proj.weight, NEW_WEIGHT_STD)
            if attn.gate == "channel":
                normal_(attn.a_up_proj.weight, NEW_WEIGHT_STD)
        if hasattr(attn, "g_proj"):
            normal_(attn.g_proj.weight, GATE_STD)
            attn.g_proj.bias.fill_(GATE_BIAS)
        attn.o_norm.weight.fill_(1.0)
    set_beta(attn, torch.full((attn.num_heads,), COPY_BETA))
    set_decay(attn, 0.5 ** (1.0 / copy_half_lives(attn.num_heads)))


def set_output_norm(attn, channel_rms: torch.Tensor) -> None:
    """Output RMSNorm weight = per-channel RMS of the teacher's attention output before `o_proj` (`[H * V]`)."""
    if channel_rms.numel() != attn.o_norm.weight.numel():
        raise ValueError(f"expected {attn.o_norm.weight.numel()} channel RMS values, got {channel_rms.numel()}")
    _copy_(attn.o_norm.weight, channel_rms.reshape(-1).float())


def scale_output_norm(attn, head_scale: torch.Tensor) -> None:
    """Multiply each head's output RMSNorm weight by its scale (`[H]`)."""
    with torch.no_grad():
        weight = attn.o_norm.weight.view(attn.num_heads, attn.value_head_dim)
        weight.mul_(head_scale.to(weight.dtype)[:, None])


def decay_from_distance(mean_distance: torch.Tensor) -> torch.Tensor:
    """Decay whose geometric weights a^k have the teacher's mean attention distance d: a = d / (1 + d)."""
    d = mean_distance.float().clamp(min=0.0)
    return (d / (1.0 + d)).clamp(MIN_DECAY, MAX_DECAY)


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
    "copy_delta_projections",
    "copy_half_lives",
    "copy_shared_weights",
    "decay_from_distance",
    "decay_of",
    "init_new_parameters",
    "repeat_kv_rows",
    "scale_output_norm",
    "set_beta",
    "set_decay",
    "set_output_norm",
]
