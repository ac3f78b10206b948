"""Which layers stay softmax attention and which become delta attention.

`--keep-attention` takes one of:

* `all` / `none`: every layer kept / every layer converted;
* an explicit list of layer indices, `0,4,8` (a single index is a list too: `8`);
* a ratio with a decimal point, `0.25`: `round(ratio * L)` layers kept, spread uniformly from layer 0
  (layer `floor(i * L / n)` for `i < n`);
* `auto:<ratio>`: keep `n = round(ratio * L)` layers: layer 0 (unless `keep_first_layer=False`), then the
  layers holding the source's induction heads, strongest first, up to `floor(induction_share * n)` of them
  (`induction.py`: the heads that copy from the context, which a one-at-a-time ranking misses), then the layers
  whose attention, replaced alone by its calibrated delta layer, raises the source's perplexity on calibration
  text most (`rank_by="bypass"`: whose attention, replaced by zeros, raises it most).

A plan may also give the kept layers a window (`--attention-window W`): every kept layer becomes a
`sliding_attention` layer attending to its last W tokens, whatever its kind in the source, so the converted
model's cache is bounded at any length (the delta states plus W keys/values per kept layer). Without a window
kept layers keep their source kind, and source sliding layers their source window.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from delta_attention.modeling.configuration_delta import DELTA_LAYER as DELTA

SLIDING = "sliding_attention"

logger = logging.getLogger(__name__)


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


# A bare `0` or `1` reads as one layer index, but is easily meant as a count or ratio: say what it does.
_AMBIGUOUS_SINGLE_INDEX = {
    "0": "no softmax layer at all pass 'none' (or the ratio 0.0)",
    "1": "every layer kept pass 'all' (or the ratio 1.0)",
}


def parse_keep(spec: str | list | tuple | None, num_layers: int) -> KeepSpec:
    """Parse a `--keep-attention` value for a model of `num_layers` layers; clear `ValueError` when wrong."""
    if spec is None:
        spec = "none"
    explicit_list = isinstance(spec, (list, tuple))
    if explicit_list:
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
    if not explicit_list and text in _AMBIGUOUS_SINGLE_INDEX:
        logger.warning("--keep-attention %r keeps layer %s as softmax attention (a single index is a list of one "
                       "layer); for %s", text, text, _AMBIGUOUS_SINGLE_INDEX[text])
    return KeepSpec(text, layers=tuple(sorted(set(indices))))


def copy_slots(count: int, share: float) -> int:
    """How many of `count` kept layers an auto plan gives to induction layers first: `floor(share * count)`."""
    return math.floor(share * count + 1e-9)


def choose_auto(costs: dict[int, float], count: int, keep_first_layer: bool = True,
                induction: list[tuple[int, float]] = (), slots: int = 0) -> tuple[int, ...]:
    """Keep `count` layers: layer 0 first when `keep_first_layer`, then up to `slots` of the `induction` layers
    (strongest first), then the layers whose `costs` (perplexity with the layer converted or bypassed) are highest."""
    ranked = sorted(costs, key=lambda i: (-costs[i], i))
    chosen = [0] if keep_first_layer and count > 0 and 0 in costs else []
    for layer, _ in induction[:slots]:
        if len(chosen) < count and layer not in chosen:
            chosen.append(layer)
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
    ranking: list[tuple[int, float]] | None = None  # auto: (layer, perplexity with it bypassed or converted alone)
    ranked_by: str = "bypass"  # auto: what `ranking` measures, the layer's attention bypassed or converted alone
    induction: list[tuple[int, float]] | None = None  # auto: (layer, its strongest induction head's score)
    baseline_perplexity: float | None = None
    sliding_window: int | None = None  # window of the converted model's sliding layers (None: it has none)
    source_sliding_window: int | None = None  # window of the source's sliding layers (None: it has none)
    attention_window: int | None = None  # the --attention-window asked for (None: kept layers keep their kind)

    @property
    def kept(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != DELTA]

    @property
    def delta(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DELTA]

    def describe(self) -> str:
        lines = [f"layer plan ({self.rule}): {len(self.kept)} of {len(self.layer_types)} layers keep softmax attention"
                 + (f", each in a sliding window of {self.attention_window} tokens" if self.attention_window else "")]
        width = max(len(layer_name(t, self.source_sliding_window)) for t in self.source_types) + 2
        for i, (src, dst) in enumerate(zip(self.source_types, self.layer_types)):
            source, target = layer_name(src, self.source_sliding_window), layer_name(dst, self.sliding_window)
            lines.append(f"  layer {i:>3}: {source:<{max(width, 26)}} -> {target}")
        if self.ranking:
            measure = "converted alone" if self.ranked_by == "conversion" else "bypassed"
            lines.append(
                f"auto ranking (perplexity with the layer's attention {measure}; "
                f"baseline {self.baseline_perplexity:.2f}): "
                + ", ".join(f"{i}:{ppl:.4g}" for i, ppl in self.ranking)
            )
        if self.induction is not None:
            lines.append("induction layers (attention on the copy target of the strongest head, repeated random "
                         "tokens): " + (", ".join(f"{i}:{score:.2f}" for i, score in self.induction) or "none"))
        return "\n".join(lines)


def layer_name(layer_type: str, window: int | None = None) -> str:
    """How layer maps name a layer kind: "softmax (full)", "softmax (sliding window 4096)" or "delta"."""
    if layer_type == DELTA:
        return "delta"
    if layer_type == SLIDING:
        return f"softmax (sliding window {window})" if window else "softmax (sliding window)"
    return "softmax (full)"


def check_window(window) -> int | None:
    """`--attention-window` as an int >= 1 (None: no window); a clear `ValueError` otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"--attention-window must be a whole number of tokens >= 1 (the keys/values each kept softmax "
                         f"layer attends to), got {window!r}")
    return window


def make_plan(source_types: list[str], kept: tuple[int, ...], rule: str, window: int | None = None,
              source_window: int | None = None, **extra) -> LayerPlan:
    """The plan keeping layers `kept` as softmax and converting the rest to delta.

    With `window` every kept layer becomes a sliding layer of that window (a source sliding layer too: the
    given window replaces the source's `source_window`); without it kept layers keep their source kind and
    the source's window.
    """
    window = check_window(window)
    kept = set(kept)
    types = [(SLIDING if window else src) if i in kept else DELTA for i, src in enumerate(source_types)]
    source_window = source_window if SLIDING in source_types else None
    target_window = (window or source_window) if SLIDING in types else None
    if SLIDING in types and not target_window:
        raise ValueError("the source has sliding-window layers but no `sliding_window` in its config; "
                         "give --attention-window W")
    return LayerPlan(list(source_types), types, rule, sliding_window=target_window, source_sliding_window=source_window,
                     attention_window=window, **extra)


__all__ = ["DELTA", "SLIDING", "KeepSpec", "LayerPlan", "check_window", "choose_auto", "copy_slots", "layer_name", "make_plan",
           "parse_keep", "uniform_layers"]
