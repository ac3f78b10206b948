"""Rolling a delta layer's recurrent state back to an earlier token (docs/design.md, "Rollback").

Speculative and prompt-lookup decoding run a block of guessed tokens through the model and keep only the prefix
the model agrees with; the cache must then forget the rest (`cache.crop(-n)`). A softmax layer drops the last
keys and values. A delta layer has folded every token into one state, so while its cache records
(`cache.activate_past_recording()`, which transformers' assisted decoding calls), it keeps what rebuilds the state
after any recent token: the state before the recorded tokens, and the inputs of their state updates (k, v, beta,
log-decay; the queries do not touch the state). `RecordedTokens.state_after(n)` replays the first n of them.

Replaying costs one recurrent step per kept token, paid only when tokens are rejected; recording costs one state
copy per layer and block plus the per-token inputs (a few KB per token and layer), and nothing when not recording.
"""

from __future__ import annotations

import torch

from .delta_rule import recurrent_delta_rule


def advance_state(state: torch.Tensor, key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor,
                  log_decay: torch.Tensor | None) -> torch.Tensor:
    """The state after folding the tokens `key`, `value`, `beta`, `log_decay` into `state` (not modified).

    state [B, H, K, V] float32; key [B, T, H, K], value [B, T, H, V], beta [B, T, H], log_decay None | [B, T, H] |
    [B, T, H, K], as `recurrent_delta_rule` takes them (its in-place step, queries set to the keys: their outputs are
    not used). Returns a new [B, H, K, V] float32 tensor.
    """
    state = state.detach().float().clone()
    if key.shape[1] == 0:
        return state
    return recurrent_delta_rule(key, key, value, beta, log_decay, initial_state=state, inplace=True)[1]


def _take(tensor: torch.Tensor | None, tokens: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[:, tokens]


class RecordedTokens:
    """The latest tokens a delta layer folded into its state while its cache records, and the state before them.

    `add` appends a block's state-update inputs; past `max_tokens` tokens the oldest are folded into `state` (the
    bound on how far back a crop can go). `state_after(n)` is the state after the first n recorded tokens.
    """

    def __init__(self, state: torch.Tensor):
        self.state = state.detach().float().clone()  # [B, H, K, V]: the state before the first recorded token
        self.keys, self.values, self.betas, self.log_decays = [], [], [], []
        self.num_tokens = 0

    @classmethod
    def starting_from(cls, state: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> RecordedTokens:
        """A record starting from `state`, or from the zero state (no past) when it is None, sized from `key`
        [B, T, H, K] and `value` [B, T, H, V]."""
        if state is None:
            batch, _, heads, key_dim = key.shape
            state = torch.zeros(batch, heads, key_dim, value.shape[-1], dtype=torch.float32, device=key.device)
        return cls(state)

    def add(self, key: torch.Tensor, value: torch.Tensor, beta: torch.Tensor, log_decay: torch.Tensor | None,
            max_tokens: int) -> None:
        """Record a block's inputs (shapes as `advance_state`), keeping at most the latest `max_tokens` tokens."""
        self.keys.append(key.detach())
        self.values.append(value.detach())
        self.betas.append(beta.detach())
        self.log_decays.append(None if log_decay is None else log_decay.detach())
        self.num_tokens += key.shape[1]
        if self.num_tokens > max_tokens:
            self._fold(self.num_tokens - max_tokens)

    def _inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The recorded inputs, concatenated over the tokens (kept concatenated afterwards)."""
        if len(self.keys) > 1:
            self.keys, self.values, self.betas = [torch.cat(self.keys, 1)], [torch.cat(self.values, 1)], [
                torch.cat(self.betas, 1)]
            self.log_decays = [None if self.log_decays[0] is None else torch.cat(self.log_decays, 1)]
        return self.keys[0], self.values[0], self.betas[0], self.log_decays[0]

    def _fold(self, count: int) -> None:
        """Fold the oldest `count` recorded tokens into `state` and forget them."""
        key, value, beta, log_decay = self._inputs()
        head, rest = slice(0, count), slice(count, None)
        self.state = advance_state(self.state, key[:, head], value[:, head], beta[:, head], _take(log_decay, head))
        self.keys, self.values, self.betas = [key[:, rest]], [value[:, rest]], [beta[:, rest]]
        self.log_decays = [_take(log_decay, rest)]
        self.num_tokens -= count

    def state_after(self, count: int) -> torch.Tensor:
        """The state after the first `count` recorded tokens (0 <= count <= num_tokens): [B, H, K, V] float32."""
        if not 0 <= count <= self.num_tokens:
            raise ValueError(f"count must be in [0, {self.num_tokens}], got {count}")
        if count == 0:
            return self.state.clone()
        key, value, beta, log_decay = self._inputs()
        head = slice(0, count)
        return advance_state(self.state, key[:, head], value[:, head], beta[:, head], _take(log_decay, head))


__all__ = ["RecordedTokens", "advance_state"]
