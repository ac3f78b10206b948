"""Cache entries of delta layers: transformers' `LinearAttentionLayer` plus a count of the tokens seen.

A delta layer's past is a fixed-size state (and the short conv's last inputs), which has no length to read
off. `DeltaLinearAttentionLayer` counts the tokens folded into its state, and knows that it holds a state
once one is written, also without a short conv (transformers sets `has_previous_state` only when the conv
window is updated). `DeltaCache` is the `DynamicCache` built from such layers, whose `get_seq_length()` also
works when every layer is a delta layer (`DynamicCache` raises there: it looks for an attention layer).

transformers builds plain `LinearAttentionLayer`s for `layer_types == "linear_attention"`, in
`DynamicCache(config=...)`, `StaticCache` and `generate`; `use_delta_layers` swaps them for counting ones, which
the model does to any cache it is given (see docs/design.md, "Pitfalls handled").
"""

from __future__ import annotations

import torch

from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer


class DeltaLinearAttentionLayer(LinearAttentionLayer):
    """A `LinearAttentionLayer` that counts the tokens it has seen (`seen_tokens`)."""

    def __init__(self, number_of_states: int = 1, **kwargs):
        super().__init__(number_of_states=number_of_states, **kwargs)
        self.seen_tokens = 0

    @classmethod
    def from_layer(cls, layer: LinearAttentionLayer) -> DeltaLinearAttentionLayer:
        """A counting layer holding `layer`'s states (the same tensors). A layer filled elsewhere counts from 0."""
        adopted = cls(number_of_states=layer.number_of_states)
        vars(adopted).update(vars(layer))
        return adopted

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, new_tokens: int = 0, **kwargs
    ) -> torch.Tensor:
        """Write the state after `new_tokens` more tokens (in place, as transformers does) and count them."""
        states = super().update_recurrent_state(recurrent_states, state_idx, **kwargs)
        self.has_previous_state[state_idx] = True
        if state_idx == 0:
            self.seen_tokens += new_tokens
        return states

    def replace_conv_state(self, window: torch.Tensor, state_idx: int = 0) -> None:
        """Overwrite the conv window [B, D, K] in place (the model keeps the last *unmasked* inputs there)."""
        self.conv_states[state_idx].copy_(window)

    def get_seq_length(self) -> int:
        """The number of tokens folded into this layer's state."""
        return self.seen_tokens

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0


def use_delta_layers(cache: Cache) -> Cache:
    """Swap `cache`'s plain `LinearAttentionLayer`s for `DeltaLinearAttentionLayer`s (in place); returns `cache`."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[index] = DeltaLinearAttentionLayer.from_layer(layer)
    return cache


def cached_length(cache: Cache | None) -> int:
    """Tokens already in `cache`, also when every layer is a delta layer (0 for layers no delta model filled)."""
    if cache is None or not cache.layers:
        return 0
    if not all(cache.is_linear):
        return cache.get_seq_length()
    first = cache.layers[0]
    return first.get_seq_length() if isinstance(first, DeltaLinearAttentionLayer) else 0


class DeltaCache(DynamicCache):
    """`DynamicCache(config=...)` with counting delta layers; `get_seq_length()` works for all-delta models too.

    What `DeltaForCausalLM` creates by default (in `forward` and `generate`). A plain `DynamicCache(config=...)` or
    `StaticCache` works as well: the model swaps in the counting layers on first use.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_delta_layers(self)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens in layer `layer_idx`: a delta layer's own count, or what `DynamicCache` says for the others."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], DeltaLinearAttentionLayer):
            return self.layers[layer_idx].get_seq_length()
        return super().get_seq_length(layer_idx)
