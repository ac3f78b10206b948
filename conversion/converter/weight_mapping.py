"""Weight mapping of a conversion: what the converted model takes over from its source.

`copy_shared_weights` copies what stays: embeddings, norms, MLPs, lm_head and the kept softmax layers.
`copy_delta_projections` gives a delta layer the source's q/o projections and its k/v projections, repeated over
the GQA groups for one state per query head, or as they are for one state per KV head (`gqa_state`).
"""

from __future__ import annotations

import torch


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` in place (in `dst`'s dtype), without autograd."""
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
        copy_tensor(dst_state[name], tensor)


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


def copy_delta_projections(src_attn, dst_attn, kv_heads: int) -> None:
    """q/o copied, k/v repeated over the GQA groups up to the delta layer's states (`dst_attn.num_state_heads`:
    one per query head, or one per KV head, then copied as they are), biases alike, q/k RMSNorm (Qwen3) copied."""
    groups = dst_attn.num_state_heads // kv_heads
    copy_tensor(dst_attn.q_proj.weight, src_attn.q_proj.weight)
    copy_tensor(dst_attn.o_proj.weight, src_attn.o_proj.weight)
    copy_tensor(dst_attn.k_proj.weight, repeat_kv_rows(src_attn.k_proj.weight, kv_heads, groups))
    copy_tensor(dst_attn.v_proj.weight, repeat_kv_rows(src_attn.v_proj.weight, kv_heads, groups))
    for name in ("q_proj", "o_proj"):
        if getattr(dst_attn, name).bias is not None:
            copy_tensor(getattr(dst_attn, name).bias, getattr(src_attn, name).bias)
    for name in ("k_proj", "v_proj"):
        if getattr(dst_attn, name).bias is not None:
            copy_tensor(getattr(dst_attn, name).bias, repeat_kv_rows(getattr(src_attn, name).bias, kv_heads, groups))
    for name in ("q_norm", "k_norm"):
        if hasattr(dst_attn, name):
            _copy_module(getattr(dst_attn, name), getattr(src_attn, name))


__all__ = ["copy_delta_projections", "copy_shared_weights", "copy_tensor", "repeat_kv_rows"]
