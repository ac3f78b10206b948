"""Cache entries of delta layers: transformers' `LinearAttentionLayer` plus a count of the tokens seen.

A delta layer's past is a fixed-size state (and the short conv's last inputs), which has no length to read
off. `DeltaLinearAttentionLayer` counts the tokens folded into its state, and knows that it holds a state
once one is written, also without a short conv (transformers sets `has_previous_state` only when the conv
window is updated). `DeltaCache` is the `DynamicCache` built from such layers, whose `get_seq_length()` also
works when every layer is a delta layer (`DynamicCache` raises there: it looks for an attention layer).

transformers builds plain `LinearAttentionLayer`s for `layer_types == "linear_attention"`, in
`DynamicCache(config=...)`, `StaticCache` and `generate`; `use_delta_layers` swaps them for counting ones, which
the model does to any cache it is given (see docs/design.md, "Pitfalls handled").

While the cache records (`activate_past_recording()`, which transformers' assisted decoding calls), a delta layer also
keeps what rebuilds its state and conv window after any of its latest `max_rollback` tokens (`delta_rollback.py`),
so `crop(-n)` rolls it back exactly, as it does softmax layers (docs/design.md, "Rollback").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformers.cache_utils import Cache, DynamicCache, LinearAttentionLayer

from .delta_rollback import RecordedTokens


#: how many of its latest tokens a recording delta layer can be rolled back by (`DeltaCache(max_rollback=...)`)
DEFAULT_MAX_ROLLBACK = 32


class DeltaLinearAttentionLayer(LinearAttentionLayer):
    """A `LinearAttentionLayer` that counts the tokens it has seen (`seen_tokens`) and, while recording, can be
    rolled back by up to `max_rollback` of its latest tokens (`crop`)."""

    def __init__(self, number_of_states: int = 1, max_rollback: int = DEFAULT_MAX_ROLLBACK, **kwargs):
        super().__init__(number_of_states=number_of_states, **kwargs)
        self.seen_tokens = 0
        self.max_rollback = max_rollback
        self.recorded: RecordedTokens | None = None  # only while recording, since the last `crop`

    @classmethod
    def from_layer(cls, layer: LinearAttentionLayer) -> DeltaLinearAttentionLayer:
        """A counting layer holding `layer`'s states (the same tensors). A layer filled elsewhere counts from 0."""
        adopted = cls(number_of_states=layer.number_of_states)
        vars(adopted).update(vars(layer))
        return adopted

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """transformers' update; while recording, the window keeps at most `max_rollback` inputs more than the
        kernel (transformers keeps every input until the next `crop`)."""
        full = super().update_conv_state(conv_states, state_idx, conv_kernel_size, **kwargs)
        if self.record_past:
            keep = self.conv_kernel_size[state_idx] + self.max_rollback
            if self.conv_states[state_idx].shape[-1] > keep:
                self.conv_states[state_idx] = self.conv_states[state_idx][..., -keep:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, new_tokens: int = 0, **kwargs
    ) -> torch.Tensor:
        """Write the state after `new_tokens` more tokens (in place, as transformers does) and count them."""
        states = super().update_recurrent_state(recurrent_states, state_idx, **kwargs)
        self.count_updated_in_place(new_tokens, state_idx)
        return states

    def count_updated_in_place(self, new_tokens: int, state_idx: int = 0) -> None:
        """`update_recurrent_state` for a state the caller has already updated in place, in the cache's own buffer
        (the model's fast decode step): count the tokens, without a copy."""
        self.has_previous_state[state_idx] = True
        if state_idx == 0:
            self.seen_tokens += new_tokens
        if not self.record_past:  # recording was switched off (as `generate` does when it returns the cache)
            self.recorded = None

    def replace_conv_state(self, window: torch.Tensor, state_idx: int = 0) -> None:
        """Overwrite the conv window [B, D, K] in place (the model keeps the last *unmasked* inputs there)."""
        if self.record_past:
            raise ValueError(
                "A padded multi-token block reached a delta layer whose cache records for a rollback (assisted or "
                "prompt-lookup decoding); rollback needs unpadded rows: pass batches without padding there."
            )
        self.conv_states[state_idx].copy_(window)

    def record_tokens(self, state: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor,
                      log_decay: torch.Tensor | None, restart: bool = False) -> None:
        """Record a block's state-update inputs (shapes as `delta_rollback.advance_state`), `state` being the
        state before them (None: no past). The model calls this before it updates the state, while recording;
        `restart` forgets what was recorded before (the block starts after more than `max_rollback` new tokens)."""
        if self.recorded is None or restart:
            self.recorded = RecordedTokens.starting_from(state, key, value)
        self.recorded.add(key, value, beta, log_decay, self.max_rollback)

    @property
    def is_croppable(self) -> bool:
        """`crop` puts this layer back exactly once recording is on (transformers' layer can only cut its conv)."""
        return True

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise, saying why, when `crop(tokens_to_remove)` cannot roll this layer back exactly."""
        if tokens_to_remove > 0:
            raise RuntimeError(
                "Delta layers can only be cropped by a negative int, the number of tokens to remove "
                f"(got {tokens_to_remove})."
            )
        removed = -tokens_to_remove
        if removed and not self.record_past:
            raise RuntimeError(
                "`crop` was called, but this delta layer does not record its past; call "
                "`cache.activate_past_recording()` before the tokens to roll back go through the model."
            )
        recorded = 0 if self.recorded is None else self.recorded.num_tokens
        if removed > recorded:
            raise ValueError(
                f"Cannot remove {removed} tokens from a delta layer that recorded {recorded} since the last crop "
                f"(it keeps at most its latest max_rollback={self.max_rollback}); build the cache with "
                f"`DeltaCache(config=model.config, max_rollback={removed})` or more and pass it as `cache=`."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last `-tokens_to_remove` tokens: the state becomes the one after the tokens kept (replayed
        from the record) and the conv window their last inputs. `crop(0)` keeps everything and ends the record.
        Removing tokens needs recording on since before them, and at most the latest `max_rollback` tokens."""
        self.check_crop(tokens_to_remove)
        removed = -tokens_to_remove
        if removed:
            self.recurrent_states[0].copy_(self.recorded.state_after(self.recorded.num_tokens - removed))
            self.seen_tokens -= removed
        self.recorded = None
        for index in range(self.number_of_states):
            if self.is_conv_states_initialized[index] and (
                removed or self.conv_states[index].shape[-1] != self.conv_kernel_size[index]
            ):
                self.conv_states[index] = self._conv_window_before(index, removed)

    def _conv_window_before(self, state_idx: int, removed: int) -> torch.Tensor:
        """The conv window [B, D, K] before the last `removed` inputs of the recorded window (zeros before the
        first input, as the window of a run that saw fewer than K tokens)."""
        inputs, width = self.conv_states[state_idx], self.conv_kernel_size[state_idx]
        end = inputs.shape[-1] - removed
        window = inputs[..., max(end - width, 0) : end]
        return F.pad(window, (width - window.shape[-1], 0)).contiguous()

    def get_seq_length(self) -> int:
        """The number of tokens folded into this layer's state."""
        return self.seen_tokens

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.recorded = None


def use_delta_layers(cache: Cache) -> Cache:
    """Swap `cache`'s plain `LinearAttentionLayer`s for `DeltaLinearAttentionLayer`s (in place); returns `cache`."""
    for index, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[index] = DeltaLinearAttentionLayer.from_layer(layer)
    return cache


def stop_recording(cache: Cache) -> None:
    """End past recording on every layer of `cache` (`crop(0)`, then recording off), as transformers does for a
    cache it hands back after a deferred stop check: later plain decoding pays nothing for rollbacks."""
    for layer in cache.layers:
        if getattr(layer, "record_past", False):
            if getattr(layer, "is_initialized", True):  # transformers' sliding layer cannot crop an empty one
                layer.crop(0)
            layer.record_past = False
        if isinstance(layer, DeltaLinearAttentionLayer):
            layer.recorded = None


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

    `max_rollback`: while recording (`activate_past_recording()`), `crop(-n)` can remove up to this many of the
    latest tokens from the delta layers (assisted decoding removes at most the number of draft tokens).
    """

    def __init__(self, *args, max_rollback: int = DEFAULT_MAX_ROLLBACK, **kwargs):
        super().__init__(*args, **kwargs)
        use_delta_layers(self)
        self.max_rollback = max_rollback

    @property
    def max_rollback(self) -> int:
        """How many of the latest tokens `crop` can remove from the delta layers while recording."""
        return min((layer.max_rollback for layer in self.layers if isinstance(layer, DeltaLinearAttentionLayer)),
                   default=DEFAULT_MAX_ROLLBACK)

    @max_rollback.setter
    def max_rollback(self, tokens: int) -> None:
        if tokens < 0:
            raise ValueError(f"max_rollback must be >= 0, got {tokens}.")
        for layer in self.layers:
            if isinstance(layer, DeltaLinearAttentionLayer):
                layer.max_rollback = tokens

    def crop(self, tokens_to_remove: int) -> None:
        """`DynamicCache.crop`, refused before any layer changes when a delta layer cannot roll back exactly."""
        for layer in self.layers:
            if isinstance(layer, DeltaLinearAttentionLayer):
                layer.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens in layer `layer_idx`: a delta layer's own count, or what `DynamicCache` says for the others."""
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], DeltaLinearAttentionLayer):
            return self.layers[layer_idx].get_seq_length()
        return super().get_seq_length(layer_idx)
