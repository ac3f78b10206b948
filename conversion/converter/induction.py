"""Induction heads of a softmax model: the heads that copy from the context.

An induction head, reading a token that occurred earlier, attends to the token that followed that earlier
occurrence, so the model can predict it again (Olsson et al.'s "induction heads"). A delta layer cannot do
this exactly: its state is a fixed-size summary of the past, not a lookup of it. Converting the layers that
hold a model's induction heads costs copying (quoted e-mail, repeated names, formulaic verse) far more than
bypass ranking shows, because such layers back each other up: with one bypassed, another still copies, so
each alone looks cheap (docs/design.md, "Layer plans").

The probe is the usual one: random tokens (drawn from real text, so no special or unused ids), the sequence
repeated once, and per head the attention weight each query of the repeat puts on the key one position after
the query token's first occurrence.
"""

from __future__ import annotations

import torch

from ..precision import autocast
from .attention_transfer import attention_layers

#: a layer counts as an induction layer when one of its heads puts at least this much attention on the copy target
INDUCTION_THRESHOLD = 0.3


def repeated_sequences(pool: torch.Tensor, length: int, count: int, seed: int = 0) -> torch.Tensor:
    """`count` sequences of `length` tokens drawn at random from `pool` (any shape of token ids), each followed
    by itself: `[count, 2 * length]`."""
    if length < 2 or count < 1:
        raise ValueError(f"need length >= 2 and count >= 1, got {length}, {count}")
    tokens = pool.flatten()
    generator = torch.Generator().manual_seed(seed)
    first = tokens[torch.randint(0, tokens.numel(), (count, length), generator=generator)]
    return torch.cat([first, first], dim=1)


def copy_attention(weights: torch.Tensor, length: int) -> torch.Tensor:
    """Per head, the mean attention weight on the copy target over the repeat's queries.

    weights [B, H, 2L, 2L] (rows over keys, causal) of sequences whose second half repeats the first -> [H]. The
    query at position q >= L reads the token first seen at q - L, so its copy target is the key q - L + 1."""
    queries = torch.arange(length, 2 * length, device=weights.device)
    return weights[:, :, queries, queries - length + 1].float().mean(dim=(0, 2))


@torch.no_grad()
def induction_scores(model, sequences: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Per layer and head, the mean attention weight on the copy target (`copy_attention`) of `model` over
    `sequences` (`repeated_sequences`): `[num_layers, num_heads]`. Runs one forward with eager attention."""
    length = sequences.shape[1] // 2
    modules = attention_layers(model)
    scores: list[torch.Tensor | None] = [None] * len(modules)

    def keep(i):
        def hook(module, args, kwargs, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if weights is None:
                raise RuntimeError(f"layer {i} returned no attention weights; eager attention is needed")
            scores[i] = copy_attention(weights.detach(), length)

        return hook

    previous = model.config._attn_implementation
    handles = [module.register_forward_hook(keep(i), with_kwargs=True) for i, module in enumerate(modules)]
    if previous != "eager":
        model.set_attn_implementation("eager")
    try:
        device = next(model.parameters()).device
        with autocast(bf16):
            model.model(input_ids=sequences.to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        if previous != "eager":
            model.set_attn_implementation(previous)
    return torch.stack(scores).cpu()


def induction_layers(scores: torch.Tensor, threshold: float = INDUCTION_THRESHOLD) -> list[tuple[int, float]]:
    """The layers whose strongest head scores at least `threshold`, strongest first: [(layer, its best score)]."""
    best = scores.max(dim=1).values
    layers = [(i, float(best[i])) for i in range(len(best)) if best[i] >= threshold]
    return sorted(layers, key=lambda item: (-item[1], item[0]))


__all__ = ["INDUCTION_THRESHOLD", "copy_attention", "induction_layers", "induction_scores", "repeated_sequences"]
