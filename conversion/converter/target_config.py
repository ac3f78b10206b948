"""The `DeltaConfig` of a converted model, derived from the source's config and the layer plan."""

from __future__ import annotations

import copy
import dataclasses

from delta_attention.modeling import DeltaConfig
from delta_attention.modeling.delta_chunk import FAST_LOG_DECAY_FLOOR


@dataclasses.dataclass
class DeltaOptions:
    """The delta-layer settings a conversion chooses (everything else comes from the source)."""

    gate: str = "channel"  # channel (KDA) | scalar (Gated DeltaNet) | none (DeltaNet)
    conv_kernel_size: int = 4  # 0 = no short conv
    output_gate: bool = True
    allow_neg_eigval: bool = False
    chunk_size: int = 64
    gqa_state: bool = False  # one state per KV head, read by its group of query heads (else one per query head)


def log_decay_floor(gate: str) -> float | None:
    """The `linear_log_decay_floor` a conversion sets: the fast kernel's floor for the channel gate, else none
    (trained per-channel decays otherwise grow steep enough to leave the fast kernel; see delta_chunk.py)."""
    return FAST_LOG_DECAY_FLOOR if gate == "channel" else None


def _bias_flags(source_config, model=None) -> tuple[bool, bool]:
    """(q/k/v bias, o bias), read from the modules when a model is given, else from the config."""
    if model is not None:
        attn = model.model.layers[0].self_attn
        return attn.q_proj.bias is not None, attn.o_proj.bias is not None
    model_type = getattr(source_config, "model_type", "")
    if model_type == "qwen2":
        return True, False
    bias = bool(getattr(source_config, "attention_bias", False))
    return bias, bias


def _has_qk_norm(source_config, model=None) -> bool:
    if model is not None:
        return hasattr(model.model.layers[0].self_attn, "q_norm")
    return getattr(source_config, "model_type", "") == "qwen3"


def _token_ids(source_config) -> dict:
    ids = {}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(source_config, name, None)
        if value is None and hasattr(source_config, "get_text_config"):
            value = getattr(source_config.get_text_config(), name, None)
        ids[name] = value
    return ids


def delta_config_from_source(source_config, layer_types: list[str], options: DeltaOptions | None = None,
                             model=None, sliding_window: int | None = None) -> DeltaConfig:
    """A `DeltaConfig` with the source's sizes, norms, positions and biases and the given layer types.

    Delta layers get one state per query head (k/v repeated over the GQA groups), or with `options.gqa_state`
    one per KV head read by its group of query heads (k/v as in the source), head dims equal to the source's,
    no activation after the short conv (it would distort the copied q/k/v), a SiLU output gate.
    `sliding_window` is the window of the `sliding_attention` layers (a plan's `sliding_window`); left out,
    they keep the source's.
    """
    options = options or DeltaOptions()
    cfg = source_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    qkv_bias, o_bias = _bias_flags(cfg, model)
    rope = copy.deepcopy(getattr(cfg, "rope_parameters", None))
    if rope is None:
        rope = {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_theta", 10000.0))}
    sliding = any(t == "sliding_attention" for t in layer_types)
    window = sliding_window if sliding_window is not None else getattr(cfg, "sliding_window", None)
    return DeltaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=getattr(cfg, "initializer_range", 0.02),
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        rope_parameters=rope,
        attention_bias=qkv_bias,
        attention_out_bias=o_bias,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        use_qk_norm=_has_qk_norm(cfg, model),
        layer_types=list(layer_types),
        sliding_window=window if sliding else None,
        linear_gate=options.gate,
        linear_num_heads=heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_conv_kernel_size=options.conv_kernel_size,
        linear_conv_activation=None,
        linear_output_gate=options.output_gate,
        linear_output_gate_activation="silu",
        linear_allow_neg_eigval=options.allow_neg_eigval,
        linear_log_decay_floor=log_decay_floor(options.gate),
        linear_chunk_size=options.chunk_size,
        linear_state_sharing="kv_head" if options.gqa_state else "head",
        **_token_ids(cfg),
    )


__all__ = ["DeltaOptions", "delta_config_from_source", "log_decay_floor"]
