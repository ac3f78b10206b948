"""Long prompts in pieces: `model(input_ids)` on a million tokens with memory independent of the length.

A delta layer carries its whole past in a fixed-size state, so a prompt can run through the model a piece at a
time, each piece continuing from the cache the previous one filled. Only the hidden states whose logits are
asked for (`logits_to_keep`) are kept. Peak memory then depends on the piece length, not on the prompt length
(for an all-delta model; softmax layers of a hybrid still grow their KV cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_freed_memory() -> None:
    """Hand the pages that freed tensors leave inside glibc's heap back to the OS (`malloc_trim`; a no-op where
    there is no glibc). Between pieces this keeps the resident size flat: without it, glibc's heap fragments over
    hundreds of pieces and the RSS creeps up (measured +13% from 8k to 256k tokens) although no tensor grows."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def wants_pieces(
    model, input_ids, inputs_embeds, attention_mask, position_ids, labels, logits_to_keep, kwargs
) -> bool:
    """Whether `DeltaForCausalLM.forward` should prefill this call in pieces: a long prompt, no gradient, no
    labels, no per-layer outputs requested, and inputs, masks and `logits_to_keep` of the plain kinds."""
    piece = getattr(model, "prefill_piece_size", None)
    tokens = input_ids if input_ids is not None else inputs_embeds
    if not piece or tokens is None or tokens.shape[1] <= piece:
        return False
    if torch.is_grad_enabled() or labels is not None:
        return False
    if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        return False
    if model.config.output_hidden_states or model.config.output_attentions:
        return False
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        return False
    if position_ids is not None and position_ids.dim() != 2:
        return False
    return isinstance(logits_to_keep, int) or (isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.dim() == 1)


def prefill_in_pieces(
    model, input_ids, inputs_embeds, attention_mask, position_ids, cache, use_cache, logits_to_keep, **kwargs
):
    """Run `model` (a `DeltaForCausalLM`) over the prompt `prefill_piece_size` tokens at a time.

    Returns the `CausalLMOutputWithPast` that one call would: logits for the positions `logits_to_keep` selects
    (an int keeps the last ones, 0 all of them; a 1D tensor the given positions) and the filled cache
    (None with `use_cache=False`).
    """
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import CausalLMOutputWithPast

    tokens = input_ids if input_ids is not None else inputs_embeds
    seq_len, piece = tokens.shape[1], model.prefill_piece_size
    if cache is None:
        cache = DynamicCache(config=model.config)
    # a 2D mask covers the cached tokens too, as in `generate`
    mask_offset = attention_mask.shape[1] - seq_len if attention_mask is not None else 0

    if isinstance(logits_to_keep, int):
        first_kept = 0 if logits_to_keep == 0 else max(seq_len - logits_to_keep, 0)
        positions = None
    else:
        positions = logits_to_keep.to(tokens.device) % seq_len
        first_kept = None

    kept, kept_order = [], []
    for start in range(0, seq_len, piece):
        end = min(start + piece, seq_len)
        hidden = model.model(
            input_ids=input_ids[:, start:end] if input_ids is not None else None,
            inputs_embeds=inputs_embeds[:, start:end] if inputs_embeds is not None else None,
            attention_mask=attention_mask[:, : mask_offset + end] if attention_mask is not None else None,
            position_ids=position_ids[:, start:end] if position_ids is not None else None,
            cache=cache,
            use_cache=True,
            **kwargs,
        ).last_hidden_state  # [B, end - start, hidden]
        if positions is None:
            if end > first_kept:
                kept.append(hidden[:, max(first_kept - start, 0) :])
        else:
            inside = torch.nonzero((positions >= start) & (positions < end)).squeeze(-1)  # indices into positions
            kept.append(hidden[:, positions[inside] - start])
            kept_order.append(inside)
        del hidden
        if tokens.device.type == "cpu":
            release_freed_memory()
    hidden = torch.cat(kept, dim=1)
    if positions is not None:  # back to the order the positions were asked in
        ordered = hidden.new_empty(hidden.shape[0], positions.shape[0], hidden.shape[-1])
        ordered[:, torch.cat(kept_order)] = hidden
        hidden = ordered
    return CausalLMOutputWithPast(logits=model.lm_head(hidden), cache=cache if use_cache is not False else None)

