"""Which layers stay softmax attention and which become delta attention.

`--keep-attention` takes one of:

* `all` / `none`: every layer kept / every layer converted;
* an explicit list of layer indices, `0,4,8` (a single index is a list too: `8`);
* a ratio with a decimal point, `0.25`: `round(ratio * L)` layers kept, spread uniformly from layer 0
  (layer `floor(i * L / n)` for `i < n`);
* `auto:<ratio>`: rank the layers by how much bypassing each one's attention raises the source's perplexity
  on calibration text, and keep the `round(ratio * L)` most costly; layer 0 is always kept unless
  `keep_first_layer=False`.
"""

from __future__ import annotations

import dataclasses
import math

from delta_attention.modeling.configuration_delta import DELTA_LAYER as DELTA


@dataclasses.dataclass
class KeepSpec:
    """A parsed `--keep-attention` value: `layers` (explicit or uniform) or an `auto_count` to rank for."""

    text: str
    layers: tuple[int, ...] | None = None
    auto_count: int | None = None

    @property
    def is_auto(self) -> bool:
        return self.auto_count is not None


def _count(ratio_text: str, num_layers: int, spec: str) -> int:
    try:
        ratio = float(ratio_text)
    except ValueError:
        raise ValueError(f"--keep-attention {spec!r}: {ratio_text!r} is not a ratio between 0 and 1") from None
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        raise ValueError(f"--keep-attention {spec!r}: the ratio must lie in [0, 1], got {ratio}")
    return min(num_layers, max(0, round(ratio * num_layers)))


def uniform_layers(count: int, num_layers: int) -> tuple[int, ...]:
    """`count` layer indices spread evenly over `num_layers`, starting at 0."""
    return tuple(sorted({(i * num_layers) // count for i in range(count)})) if count else ()


def parse_keep(spec: str | list | tuple | None, num_layers: int) -> KeepSpec:
    """Parse a `--keep-attention` value for a model of `num_layers` layers; clear `ValueError` when wrong."""
    if spec is None:
        spec = "none"
    if isinstance(spec, (list, tuple)):
        spec = ",".join(str(int(i)) for i in spec)
    text = str(spec).strip()
    lowered = text.lower()
    if lowered == "all":
        return KeepSpec(text, layers=tuple(range(num_layers)))
    if lowered in ("none", ""):
        return KeepSpec(text, layers=())
    if lowered.startswith("auto"):
        ratio_text = lowered[len("auto"):].lstrip(":") or "0.25"
        return KeepSpec(text, auto_count=_count(ratio_text, num_layers, text))
    if "." in text:
        return KeepSpec(text, layers=uniform_layers(_count(text, num_layers, text), num_layers))
    indices = []
    for part in text.split(","):
        part = part.strip()
        try:
            index = int(part)
        except ValueError:
            raise ValueError(
                f"--keep-attention {text!r}: expected 'all', 'none', a list of layer indices like 0,4,8, "
                "a ratio like 0.25, or auto:<ratio>"
            ) from None
        if not 0 <= index < num_layers:
            raise ValueError(
                f"--keep-attention {text!r}: layer index {index} is out of range; the model has {num_layers} "
                f"layers (0..{num_layers - 1})"
            )
        indices.append(index)
    return KeepSpec(text, layers=tuple(sorted(set(indices))))


def choose_auto(costs: dict[int, float], count: int, keep_first_layer: bool = True) -> tuple[int, ...]:
    """Keep the `count` layers whose bypass costs most (layer 0 first when `keep_first_layer`)."""
    ranked = sorted(costs, key=lambda i: (-costs[i], i))
    chosen = [0] if keep_first_layer and count > 0 and 0 in costs else []
    for layer in ranked:
        if len(chosen) >= count:
            break
        if layer not in chosen:
            chosen.append(layer)
    return tuple(sorted(chosen))


@dataclasses.dataclass
class LayerPlan:
    """The converted model's layer types, next to the source's, and how they were chosen."""

    source_types: list[str]
    layer_types: list[str]
    rule: str
    ranking: list[tuple[int, float]] | None = None  # auto: (layer, perplexity with its attention bypassed)
    baseline_perplexity: float | None = None

    @property
    def kept(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != DELTA]

    @property
    def delta(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DELTA]

    def describe(self) -> str:
        lines = [f"layer plan ({self.rule}): {len(self.kept)} of {len(self.layer_types)} layers keep softmax attention"]
        names = {"full_attention": "softmax (full)", "sliding_attention": "softmax (sliding window)", DELTA: "delta"}
        for i, (src, dst) in enumerate(zip(self.source_types, self.layer_types)):
            lines.append(f"  layer {i:>3}: {names[src]:<26} -> {names[dst]}")
        if self.ranking:
            lines.append(
                "auto ranking (perplexity with the layer's attention bypassed; "
                f"baseline {self.baseline_perplexity:.2f}): "
                + ", ".join(f"{i}:{ppl:.4g}" for i, ppl in self.ranking)
            )
        return "\n".join(lines)


def make_plan(source_types: list[str], kept: tuple[int, ...], rule: str, **extra) -> LayerPlan:
    types = [src if i in kept else DELTA for i, src in enumerate(source_types)]
    return LayerPlan(list(source_types), types, rule, **extra)


__all__ = ["DELTA", "KeepSpec", "LayerPlan", "choose_auto", "make_plan", "parse_keep", "uniform_layers"]
