"""A delta decoder layer's decode step (one new token per row) as one function, and its `torch.compile`d form.

An opt-in of CPU inference (`DeltaForCausalLM.enable_compiled_decode()`; docs/design.md, "Compiled decode step").
Eagerly, a delta layer's decode step is about forty small ops around its five or six matmuls (norms, the conv window,
the q/k normalisation, beta and the decay, the state update, the output norm and gate, the residual adds, the MLP's
activation), each paying PyTorch's per-op overhead on a single row. `layer_token_step` is the whole decoder layer
for one token as one plain-PyTorch function of tensors, the same maths as the model's eager fast path
(`DeltaAttention._inference_step` for one token, then the residual add and the MLP); `compiled_layer_token_step`
runs it through `torch.compile` (inductor), which fuses everything between the matmuls into a few loops. All
delta layers of a model share one compiled graph (weights are inputs; only shapes, dtypes and the `TokenStepSpec`
make new ones), compiled at the first decode step: 6-9 s on two CPU cores at SmolLM2's shapes.

Where inductor cannot compile (no working C++ compiler, an unsupported platform) `compiled_layer_token_step` logs one
line (logger `__name__`, WARNING) and returns None from then on, and the model takes its eager path.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F


logger = logging.getLogger(__name__)

#: activations the compiled step knows (config names, as `transformers.activations.ACT2FN` maps them); a layer
#: configured with another one keeps the eager path
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class TokenStepSpec(NamedTuple):
    """What a delta decoder layer's token step depends on besides its tensors (static: each distinct spec compiles
    a graph of its own). Widths and flags as `DeltaConfig` sets them."""

    heads: int  # query heads H
    state_heads: int  # states Hs (H, or the KV heads with a shared state)
    key_dim: int  # K
    value_dim: int  # V
    input_widths: tuple[int, ...]  # the fused input projection's pieces: q|k|v, b, [a], [g]
    gate: str  # "scalar", "channel" or "none"
    conv_activation: str | None  # None: no short conv, or one without an activation ("identity")
    has_conv: bool
    qk_norm: bool
    allow_neg_eigval: bool
    log_decay_floor: float | None
    output_gate_activation: str | None  # None: no output gate
    mlp_activation: str
    rms_norm_eps: float  # every RMSNorm of the layer (input, post-attention, q/k, output)
    l2_norm_eps: float


class TokenStepWeights(NamedTuple):
    """A delta decoder layer's tensors for `layer_token_step` (None where the layer has no such part)."""

    input_norm: torch.Tensor  # [hidden]
    inputs_weight: torch.Tensor  # the fused input projection [sum of input_widths, hidden]
    inputs_bias: torch.Tensor | None  # [sum of input_widths]
    conv_weight: torch.Tensor | None  # [D, K], D = the q|k|v width
    dt_bias: torch.Tensor | None  # [Hs] (scalar gate) or [Hs * K] (channel gate)
    A_log: torch.Tensor | None  # [Hs]
    a_up_weight: torch.Tensor | None  # the channel gate's up projection [Hs * K, low rank]
    q_norm: torch.Tensor | None  # [K]
    k_norm: torch.Tensor | None  # [K]
    o_norm: torch.Tensor  # [H * V]
    o_weight: torch.Tensor  # [hidden, H * V]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_weight: torch.Tensor  # the MLP's projections
    gate_bias: torch.Tensor | None
    up_weight: torch.Tensor
    up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def layer_token_step(hidden_states: torch.Tensor, conv_window: torch.Tensor | None, state: torch.Tensor,
                     weights: TokenStepWeights, spec: TokenStepSpec) -> torch.Tensor:
    """One delta decoder layer for one new token per row: hidden_states [B, 1, hidden] -> [B, 1, hidden].

    Updates in place the cache's conv window `conv_window` [B, D, K] (the last K inputs of the short conv; None
    without one) and the float32 `state` [B, Hs, K, V]. The maths of `DeltaAttention._inference_step` for one token
    (16-bit models: projections, conv and gate in the model's dtype, q/k, beta, decay and the state in float32),
    written as broadcast products and sums that inductor fuses rather than as batched matmuls."""
    batch = hidden_states.shape[0]
    heads, state_heads, key_dim, value_dim = spec.heads, spec.state_heads, spec.key_dim, spec.value_dim
    x = F.rms_norm(hidden_states, weights.input_norm.shape, weights.input_norm, spec.rms_norm_eps)
    pieces = F.linear(x, weights.inputs_weight, weights.inputs_bias).split(spec.input_widths, dim=-1)
    mixed_qkv, b = pieces[0], pieces[1]  # [B, 1, D], [B, 1, Hs]

    if spec.has_conv:  # the window slides by one input; the conv's output is its weighted sum
        window = torch.cat([conv_window[..., 1:], mixed_qkv.transpose(1, 2)], dim=-1)  # [B, D, K]
        conv_window.copy_(window)
        mixed_qkv = (window * weights.conv_weight).sum(-1)  # [B, D]
        if spec.conv_activation is not None:
            mixed_qkv = ACTIVATIONS[spec.conv_activation](mixed_qkv)
    mixed_qkv = mixed_qkv.reshape(batch, -1).float()
    query_key = mixed_qkv[:, : (heads + state_heads) * key_dim].unflatten(-1, (heads + state_heads, key_dim))
    if spec.qk_norm:
        eps = spec.rms_norm_eps
        query_key = torch.cat([F.rms_norm(query_key[:, :heads], (key_dim,), weights.q_norm.float(), eps),
                               F.rms_norm(query_key[:, heads:], (key_dim,), weights.k_norm.float(), eps)], 1)
    # l2_normalize(x) = rms_norm(x, eps / K) / sqrt(K); the queries also take the K^-0.5 scale
    query_key = F.rms_norm(query_key, (key_dim,), eps=spec.l2_norm_eps / key_dim)
    query = query_key[:, :heads] * (1.0 / key_dim)  # [B, H, K]
    key = query_key[:, heads:] * key_dim**-0.5  # [B, Hs, K], unit length
    value = mixed_qkv[:, (heads + state_heads) * key_dim :].unflatten(-1, (state_heads, value_dim))  # [B, Hs, V]
    beta = b.reshape(batch, state_heads).float().sigmoid()  # [B, Hs]
    if spec.allow_neg_eigval:
        beta = beta * 2.0

    if spec.gate != "none":  # Mamba2-style log-decay -exp(A_log) * softplus(a + dt_bias), per state or channel
        a = pieces[2]
        if spec.gate == "channel":
            a = F.linear(a, weights.a_up_weight)
        a = a.reshape(batch, -1).float() + weights.dt_bias.float()
        rate = weights.A_log.float().exp()
        if spec.gate == "channel":
            log_decay = -rate[:, None] * F.softplus(a.unflatten(-1, (state_heads, key_dim)))  # [B, Hs, K]
        else:
            log_decay = (-rate * F.softplus(a))[..., None]  # [B, Hs, 1]
        if spec.log_decay_floor is not None:
            log_decay = log_decay.clamp(min=spec.log_decay_floor)
        state_now = state * log_decay.exp()[..., None]  # [B, Hs, K, V]
    else:
        state_now = state
    # the delta rule: S <- S + k beta (v - S^T k)^T, then o = q S
    delta = (value - (key[..., None] * state_now).sum(-2)) * beta[..., None]  # [B, Hs, V]
    state_now = state_now + key[..., None] * delta[:, :, None, :]
    state.copy_(state_now)
    groups = heads // state_heads  # query heads reading each state
    output = (query.view(batch, state_heads, groups, key_dim, 1) * state_now[:, :, None]).sum(-2)  # [B, Hs, G, V]
    output = F.rms_norm(output.reshape(batch, heads, value_dim), (value_dim,), eps=spec.rms_norm_eps)
    output = (output * weights.o_norm.view(heads, value_dim)).to(hidden_states.dtype)  # o_norm
    output = output.reshape(batch, 1, heads * value_dim)
    if spec.output_gate_activation is not None:
        output = output * ACTIVATIONS[spec.output_gate_activation](pieces[-1])
    hidden_states = hidden_states + F.linear(output, weights.o_weight, weights.o_bias)

    x = F.rms_norm(hidden_states, weights.post_norm.shape, weights.post_norm, spec.rms_norm_eps)
    gate = ACTIVATIONS[spec.mlp_activation](F.linear(x, weights.gate_weight, weights.gate_bias))
    mlp = F.linear(gate * F.linear(x, weights.up_weight, weights.up_bias), weights.down_weight, weights.down_bias)
    return hidden_states + mlp


_compiled = None  # the compiled `layer_token_step`, made at the first call
_compile_failed = False  # set once inductor has failed to compile: the model's eager path runs from then on


def compiled_layer_token_step(hidden_states: torch.Tensor, conv_window: torch.Tensor | None, state: torch.Tensor,
                              weights: TokenStepWeights, spec: TokenStepSpec) -> torch.Tensor | None:
    """`layer_token_step` compiled by `torch.compile` (inductor), or None where it cannot be compiled (logged once;
    nothing is updated then) or while an outer `torch.compile` traces the caller."""
    global _compiled, _compile_failed
    if _compile_failed or torch.compiler.is_compiling():
        return None
    if _compiled is None:
        # static shapes: a decode step's shapes are fixed, and one graph serves every layer of a model; another batch
        # size, dtype or spec compiles again (past dynamo's recompile limit, 8, the function runs uncompiled)
        _compiled = torch.compile(layer_token_step, dynamic=False, fullgraph=True)
    try:
        return _compiled(hidden_states, conv_window, state, weights, spec)
    except Exception as error:
        if not _is_compile_failure(error):
            raise
        _compile_failed = True  # compiling comes before running: conv window and state are untouched
        reason = str(error).strip().splitlines()[0]
        logger.warning("delta decode step: torch.compile failed (%s); using the eager path (slower, the same maths)",
                       reason)
        return None


def _is_compile_failure(error: Exception) -> bool:
    # what dynamo raises when inductor cannot build the graph (no working C++ compiler, a codegen error)
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return isinstance(error, (BackendCompilerFailed, InductorError))


def reset_compiled() -> None:
    """Forget the compiled function and any failure, so that the next call compiles again (tests, or after
    changing inductor's settings)."""
    global _compiled, _compile_failed
    _compiled, _compile_failed = None, False
