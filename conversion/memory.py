"""Parameter counts and inference memory: KV bytes per token versus the fixed delta state (from a config), and the
bytes a live cache holds (`cache_bytes`)."""

from __future__ import annotations

import dataclasses

import torch

from delta_attention.modeling.configuration_delta import delta_layer_indices

_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def dtype_bytes(dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    return _DTYPE_BYTES.get(dtype, 4)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def count_from_config(config) -> int:
    """Parameters of the model a config describes, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count_parameters(model)


@dataclasses.dataclass
class CacheFigures:
    """Per-sequence inference cache of one model at batch 1.

    `kv_per_token`: bytes of K/V added per token by full-attention layers; `sliding_per_token` and
    `sliding_window`: the same for sliding-window layers, which hold `min(tokens, sliding_window)` tokens (what
    a `StaticCache` allocates; transformers' `DynamicCache` keeps one token fewer between forward calls);
    `state_bytes`: the fixed size of all delta states (float32; one per head, or per KV head with a GQA-shared
    state) and short-conv states; `states_per_layer`: delta states in each delta layer (0 without delta layers).
    """

    kv_per_token: int
    sliding_per_token: int
    sliding_window: int | None
    state_bytes: int
    states_per_layer: int = 0

    def total(self, tokens: int) -> int:
        """Cache bytes after `tokens` tokens."""
        sliding_tokens = min(tokens, self.sliding_window) if self.sliding_window else tokens
        return self.kv_per_token * tokens + self.sliding_per_token * sliding_tokens + self.state_bytes

    @property
    def bound(self) -> int | None:
        """The most bytes the cache ever holds, whatever the length (None: it grows with every token)."""
        if self.kv_per_token:
            return None
        return self.sliding_per_token * (self.sliding_window or 0) + self.state_bytes


def cache_figures(config, layer_types: list[str], dtype=torch.float32) -> CacheFigures:
    """Cache figures for `config` (a source config or a `DeltaConfig`) with the given layer types."""
    width = dtype_bytes(dtype)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_layer_kv = 2 * kv_heads * head_dim * width
    full = sum(t == "full_attention" for t in layer_types)
    sliding = sum(t == "sliding_attention" for t in layer_types)
    delta = len(delta_layer_indices(layer_types))
    state = states = 0
    if delta:
        d_heads = getattr(config, "linear_num_heads", None) or heads  # query heads
        states = getattr(config, "linear_num_state_heads", None) or d_heads  # fewer with a GQA-shared state
        d_key = getattr(config, "linear_key_head_dim", None) or head_dim
        d_value = getattr(config, "linear_value_head_dim", None) or head_dim
        kernel = getattr(config, "linear_conv_kernel_size", 4)
        conv_channels = d_heads * d_key + states * (d_key + d_value)  # [q | k | v]
        state = delta * (states * d_key * d_value * 4 + kernel * conv_channels * width)
    window = getattr(config, "sliding_window", None) if sliding else None
    return CacheFigures(full * per_layer_kv, sliding * per_layer_kv, window, state, states)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


CONTEXTS = (8192, 131_072, 1_048_576)


def _bound_text(figures: CacheFigures) -> str:
    """The largest cache at any length, as a table cell."""
    return "grows with the context" if figures.bound is None else f"at most {human_bytes(figures.bound)}"


def _sliding_text(figures: CacheFigures) -> str:
    """Bytes per token of the sliding layers times their window, as a table cell."""
    if not figures.sliding_per_token:
        return "-"
    return f"{human_bytes(figures.sliding_per_token)}/token x {figures.sliding_window:,}"


@dataclasses.dataclass
class MemoryReport:
    """Parameters and inference cache of a source and its conversion, as the dry run, the log and the card show them."""

    source_parameters: int
    converted_parameters: int
    source_cache: CacheFigures
    converted_cache: CacheFigures
    dtype_name: str

    def rows(self) -> list[tuple[str, str, str]]:
        src, dst = self.source_cache, self.converted_cache
        rows = [
            ("parameters", f"{self.source_parameters:,}", f"{self.converted_parameters:,}"),
            ("KV bytes per token (growing)", human_bytes(src.kv_per_token), human_bytes(dst.kv_per_token)),
            ("sliding-window KV (bounded)", _sliding_text(src), _sliding_text(dst)),
            ("delta state (fixed, per sequence)", human_bytes(src.state_bytes), human_bytes(dst.state_bytes)),
            ("delta states per delta layer", str(src.states_per_layer or "-"), str(dst.states_per_layer or "-")),
        ]
        for tokens in CONTEXTS:
            rows.append((f"cache at {tokens:,} tokens", human_bytes(src.total(tokens)), human_bytes(dst.total(tokens))))
        rows.append(("cache at any length", _bound_text(src), _bound_text(dst)))
        return rows

    def describe(self) -> str:
        lines = [f"memory (batch 1, {self.dtype_name} KV cache, float32 delta state):",
                 f"  {'':<36}{'source':>26}{'converted':>26}"]
        lines += [f"  {name:<36}{a:>26}{b:>26}" for name, a, b in self.rows()]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {
            "source_parameters": self.source_parameters,
            "converted_parameters": self.converted_parameters,
            "source": dataclasses.asdict(self.source_cache),
            "converted": dataclasses.asdict(self.converted_cache),
            "dtype": self.dtype_name,
        }


def memory_report(source_config, delta_config, source_types, dtype, source_parameters=None,
                  converted_parameters=None) -> MemoryReport:
    """Parameters and cache figures of the source (`source_types`) and the converted model (its `layer_types` and
    `sliding_window`); parameters are counted on the meta device when not given."""
    if source_parameters is None:
        source_parameters = count_from_config(source_config)
    if converted_parameters is None:
        converted_parameters = count_from_config(delta_config)
    name = str(dtype).replace("torch.", "") if not isinstance(dtype, str) else dtype
    return MemoryReport(
        source_parameters,
        converted_parameters,
        cache_figures(source_config, source_types, dtype),
        cache_figures(delta_config, delta_config.layer_types, dtype),
        name,
    )


def cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: KV tensors of softmax layers, conv and recurrent states of delta layers
    (linear-attention cache layers keep those in dicts)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, name, None)
            if isinstance(value, dict):
                value = list(value.values())
            for tensor in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


__all__ = ["CacheFigures", "MemoryReport", "cache_bytes", "cache_figures", "count_from_config", "count_parameters",
           "human_bytes", "memory_report"]
