"""Frozen linear weights cast to the autocast dtype once, not at every call.

Autocast keeps the copies it casts only for trainable leaf tensors: a frozen weight (the teacher's, the base weights
under LoRA, the LM heads) is cast again at every call: of a stage-2 distillation step of SmolLM2-135M (4 x 512 tokens,
two CPU cores, 10 s) that was about 0.6 s. `FrozenLinearCasts` keeps one cast copy of each frozen `nn.Linear` weight (and
bias) and puts it in the layer's place for the length of a `with` block, so the layer multiplies with it as it is.
Autocast rounds a float32 weight to bf16 the same way every time, so the products are the same bit for bit.

A copy is made again when its weight changed in place (its version counter moved) or another tensor took its place;
a layer whose weight trains (`requires_grad`) is left to autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class FrozenLinearCasts:
    """Cast copies of the frozen `nn.Linear` weights of some models, kept between `with cast_in(...)` blocks."""

    def __init__(self):
        # id(parameter) -> (parameter, its version when cast, the dtype, the cast copy)
        self._copies: dict[int, tuple[torch.Tensor, int, torch.dtype, nn.Parameter]] = {}

    def _copy(self, parameter: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
        """The cast copy of `parameter` in `dtype`, made now if there is none that is current."""
        kept = self._copies.get(id(parameter))
        if kept is not None and kept[0] is parameter and kept[1] == parameter._version and kept[2] == dtype:
            return kept[3]
        copy = nn.Parameter(parameter.detach().to(dtype), requires_grad=False)
        self._copies[id(parameter)] = (parameter, parameter._version, dtype, copy)
        return copy

    @contextlib.contextmanager
    def cast_in(self, *models: nn.Module, device_type: str = "cpu") -> Iterator[None]:
        """Within the block, every `nn.Linear` (subclasses included) of `models` whose parameters are all frozen
        holds its weight and bias as copies in the autocast dtype of `device_type`; on leaving, the float weights
        are back in place. Nothing is changed when autocast is off there, or for floating weights already in
        that dtype. Only calls under that autocast may run inside the block: outside it a float32 input would
        meet a bf16 weight."""
        if not torch.is_autocast_enabled(device_type):
            yield
            return
        dtype = torch.get_autocast_dtype(device_type)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for model in models:
                # a layer met twice (in two of `models`) holds its copies by then and is passed over
                for layer in model.modules():
                    if not isinstance(layer, nn.Linear):
                        continue
                    own = list(layer.named_parameters(recurse=False))
                    if any(p.requires_grad for _, p in own):
                        continue
                    for name, parameter in own:
                        if parameter.is_floating_point() and parameter.dtype != dtype \
                                and parameter.device.type == device_type:
                            layer._parameters[name] = self._copy(parameter, dtype)
                            swapped.append((layer, name, parameter))
            yield
        finally:
            for layer, name, parameter in reversed(swapped):
                layer._parameters[name] = parameter


__all__ = ["FrozenLinearCasts"]
