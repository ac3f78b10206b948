"""Model benchmarks: decode ms/token and cache bytes at long contexts, prefill tokens/s, and a 1M-token prompt.

SmolLM2-135M-shaped models (30 layers, hidden 576, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, random
weights): all-delta, hybrid (every 4th layer softmax, layers 0, 4, ..., 28) and the same-size `LlamaForCausalLM`
with sdpa by default (`MODELS` lists two more all-delta layouts with fewer weights). For decode the caches are
synthesized: random tensors of the right shapes for a given context (a real 64k-token prefill of the Llama would
dominate the run), then real decode steps on top.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

from delta_attention.conversion.evaluation.peak_memory import PeakRSS
from delta_attention.conversion.memory import cache_bytes
from delta_attention.modeling.configuration_delta import DELTA_LAYER, FULL_ATTENTION_LAYER

from .bench_kernels import timed


SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=1 << 21,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)


#: the models `build_models` knows, in the order they are built and timed: "delta-gqa" is all-delta with one state
#: per KV head (`convert --gqa_state`: k and v per KV head, as Llama has them), "delta-gqa-ungated" that without the
#: output gate (`--no_output_gate`), the all-delta layout whose weights are Llama's plus a few thousand per layer
MODELS = ("delta", "delta-gqa", "delta-gqa-ungated", "hybrid", "llama")
DEFAULT_MODELS = ("delta", "hybrid", "llama")


def build_models(dtype: torch.dtype, shape: dict | None = None, which=DEFAULT_MODELS) -> dict:
    """The models of `which` (names from `MODELS`) by name, eval mode, random weights of a fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from delta_attention import DeltaConfig, DeltaForCausalLM

    unknown = sorted(set(which) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown benchmark model(s) {unknown}; choose from {list(MODELS)}")
    shape = dict(SMOLLM2_SHAPE if shape is None else shape)
    layers = shape["num_hidden_layers"]
    all_delta = [DELTA_LAYER] * layers
    delta_options = {  # DeltaConfig fields beyond the shape, per delta model
        "delta": dict(layer_types=all_delta),
        "delta-gqa": dict(layer_types=all_delta, linear_state_sharing="kv_head"),
        "delta-gqa-ungated": dict(layer_types=all_delta, linear_state_sharing="kv_head", linear_output_gate=False),
        "hybrid": dict(layer_types=[FULL_ATTENTION_LAYER if i % 4 == 0 else DELTA_LAYER for i in range(layers)]),
    }
    models = {}
    torch.manual_seed(0)
    for name in MODELS:
        if name not in which:
            continue
        if name == "llama":
            models[name] = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
        else:
            models[name] = DeltaForCausalLM(DeltaConfig(**shape, **delta_options[name]))
    return {name: model.to(dtype).eval() for name, model in models.items()}


def synthesized_cache(model, context: int, static_steps: int | None = None):
    """A cache that looks as if `context` tokens had been prefilled: random keys/values and states.

    With `static_steps`, a `StaticCache` of `context + static_steps` slots (keys/values written in place each step);
    otherwise the `DynamicCache` that `generate` uses by default.
    """
    from transformers.cache_utils import LinearAttentionCacheLayerMixin, StaticCache

    from delta_attention import DeltaCache
    from delta_attention.modeling.delta_cache import use_delta_layers

    config = model.config
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(1)
    if static_steps is None:
        cache = DeltaCache(config=config)
    else:
        cache = use_delta_layers(StaticCache(config=config, max_cache_len=context + static_steps))
    kv_shape = (1, config.num_key_value_heads, context, config.head_dim)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            attention = model.model.layers[index].self_attn
            if attention.conv_kernel_size:
                conv = torch.randn(1, attention.conv1d.weight.shape[0], attention.conv_kernel_size, generator=generator)
                cache.update_conv_state(conv.to(dtype), index, conv_kernel_size=attention.conv_kernel_size)
            state = torch.randn(1, attention.num_state_heads, attention.key_head_dim, attention.value_head_dim,
                                generator=generator)
            cache.update_recurrent_state(state * 0.1, index, new_tokens=context)
        else:
            keys = torch.randn(kv_shape, generator=generator).to(dtype)
            values = torch.randn(kv_shape, generator=generator).to(dtype)
            if static_steps is None:
                cache.update(keys, values, index)
            else:
                layer.lazy_initialization(keys[:, :, :1], values[:, :, :1])
                layer.keys[:, :, :context] = keys
                layer.values[:, :, :context] = values
                layer.cumulative_length.fill_(context)
    return cache


def decode_step_times(model, cache, token: torch.Tensor, steps: int, warmup: int = 1
                      ) -> tuple[list[float], torch.Tensor]:
    """Seconds of each of `steps` greedy decode steps (one token in, logits of one token out) on `cache`, after
    `warmup` untimed ones, starting from `token` [1, 1]; returns them and the next token."""
    times = []
    with torch.no_grad():
        for step in range(warmup + steps):
            begin = time.perf_counter()
            logits = model(token, cache=cache, use_cache=True, logits_to_keep=1).logits
            if step >= warmup:
                times.append(time.perf_counter() - begin)
            token = logits[:, -1:].argmax(-1)
    return times, token


def delta_layer_ms_per_token(model, cache, repeats: int = 50) -> float:
    """Median ms of one token through one delta layer (`DeltaAttention`, its state updated in the cache)."""
    layer = model.model.layers[0].self_attn
    hidden = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    hidden = hidden.to(next(model.parameters()).dtype)
    with torch.no_grad():
        seconds = timed(lambda: layer(hidden, attention_mask=None, cache=cache), min_repeats=repeats,
                        min_seconds=0.0, max_repeats=repeats, warmup=5)
    return seconds * 1e3


def run_decode_benchmark(models: dict, contexts, steps: int, log=print) -> dict:
    """Decode ms/token and cache bytes per model and context: one delta layer alone, then the models' whole steps,
    one step of each model in turn (the median of `steps` steps each)."""
    rows = []
    if "delta" in models:
        for context in contexts:
            cache = synthesized_cache(models["delta"], context)
            ms = delta_layer_ms_per_token(models["delta"], cache)
            size = cache_bytes(cache) // models["delta"].config.num_hidden_layers
            rows.append({"model": "one delta layer", "context": context, "ms_per_token": ms, "cache_bytes": size})
            log(f"decode {'one delta layer':20s} context {context:6d}: {ms:8.3f} ms/token, cache {size / 2**20:8.2f} MiB")
    # (model, cache) in the models' order: "static" a StaticCache, for the models with softmax layers; the "+packed"
    # copies (`with_packed_weights`) beside their models
    variants = []
    for name, model in models.items():
        variants.append((name, None))
        kinds = getattr(model.config, "layer_types", None) or ["full_attention"]  # Llama: softmax layers only
        if any(kind != "linear_attention" for kind in kinds) and not name.endswith("+packed"):
            variants.append((name, "static"))
    for context in contexts:
        # one untimed step of every model, then one timed step of each in turn: a slower or faster spell of a shared
        # machine falls on all of them alike, and every model's step starts after the others' steps (its weights
        # no warmer than theirs). Turns of several steps per model read 20-35% apart from run to run on a busy
        # machine; steps in turn agree within a few percent.
        caches = {v: synthesized_cache(models[v[0]], context, static_steps=steps + 5 if v[1] else None)
                  for v in variants}
        tokens = {v: torch.tensor([[17]]) for v in variants}
        times = {v: [] for v in variants}
        for v in variants:
            _, tokens[v] = decode_step_times(models[v[0]], caches[v], tokens[v], 0)
        for _ in range(steps):
            for v in variants:
                measured, tokens[v] = decode_step_times(models[v[0]], caches[v], tokens[v], 1, warmup=0)
                times[v] += measured
        for (name, kind), cache in caches.items():
            label = name if kind is None else f"{name}+StaticCache"
            size = cache_bytes(cache)
            ms = statistics.median(times[(name, kind)]) * 1e3
            rows.append({"model": label, "context": context, "ms_per_token": ms, "cache_bytes": size})
            log(f"decode {label:20s} context {context:6d}: {ms:8.2f} ms/token, cache {size / 2**20:8.1f} MiB")
        del caches
        gc.collect()
    return {"steps": steps,
            "cache": f"synthesized (random tensors of the right shapes), then real decode steps, one step of each "
                     f"model in turn ({steps} timed steps each, after one untimed)",
            "rows": rows}


def prefill_tokens_per_second(model, length: int, vocab: int) -> float:
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        seconds = timed(lambda: model(ids, logits_to_keep=1), min_repeats=1, min_seconds=0.0)
    return length / seconds


def with_packed_weights(models: dict, log=print, min_bytes: int | None = None) -> dict:
    """`models` and, beside each delta model, a copy with packed weights (`pack_linear_weights`, its default size
    threshold unless `min_bytes`) as "NAME+packed"; none where no weight is large enough."""
    out = {}
    for name, model in models.items():
        out[name] = model
        if hasattr(model, "pack_linear_weights"):
            packed = copy.deepcopy(model)
            added = packed.pack_linear_weights() if min_bytes is None else packed.pack_linear_weights(min_bytes)
            if added:
                out[f"{name}+packed"] = packed
                log(f"{name}+packed: {added / 2**20:.0f} MiB of packed weights")
    return out


def with_compiled_decode(models: dict) -> dict:
    """`models` and, beside each delta model, a copy whose delta layers decode through the compiled step
    (`enable_compiled_decode`) as "NAME+compiled"."""
    out = {}
    for name, model in models.items():
        out[name] = model
        if hasattr(model, "enable_compiled_decode") and not name.endswith("+packed"):
            compiled = copy.deepcopy(model)
            compiled.enable_compiled_decode()
            out[f"{name}+compiled"] = compiled
    return out


def run_prefill_benchmark(models: dict, lengths, log=print) -> dict:
    """Prefill tokens/s per model and prompt length (the packed and compiled copies are skipped: a prompt has more
    rows than a packed weight takes, and more tokens than the compiled step, so they would time the same path
    again)."""
    rows = []
    models = {name: model for name, model in models.items() if not name.endswith(("+packed", "+compiled"))}
    for length in lengths:
        for name, model in models.items():
            rate = prefill_tokens_per_second(model, length, model.config.vocab_size)
            rows.append({"model": name, "tokens": length, "tokens_per_second": rate})
            log(f"prefill {name:8s} {length:6d} tokens: {rate:8.0f} tokens/s")
            gc.collect()
    return {"rows": rows}


LONG_MODEL_SHAPE = dict(
    vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
)


def _long_prompt_child(length: int, dtype_name: str, threads: int, shape: dict, piece_size: int | None, queue) -> None:
    """In a fresh process: one prompt of `length` tokens through the small all-delta model; reports the time and
    the process's peak RSS (so that what an earlier, shorter run left in the allocator does not count)."""
    from delta_attention import DeltaConfig, DeltaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = DeltaForCausalLM(DeltaConfig(**shape)).to(getattr(torch, dtype_name)).eval()
    piece_size = piece_size or model.prefill_piece_size
    ids = torch.randint(3, shape["vocab_size"], (1, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.prefill(ids[:, : min(length, 1024)], piece_size=piece_size, logits_to_keep=1)  # warm-up
        with PeakRSS() as rss:
            begin = time.perf_counter()
            out = model.prefill(ids, piece_size=piece_size, logits_to_keep=1)
            seconds = time.perf_counter() - begin
    assert out.logits.shape == (1, 1, shape["vocab_size"])
    # sampled, not getrusage: Linux carries ru_maxrss over from the parent through fork and exec
    queue.put({"tokens": length, "seconds": seconds, "tokens_per_second": length / seconds,
               "peak_rss_bytes": rss.peak, "rss_increase_bytes": rss.peak - rss.baseline,
               "piece_size": piece_size})


def run_long_prompt_benchmark(tokens: int, reference_tokens: int, dtype: torch.dtype, log=print,
                              shape: dict | None = None, piece_size: int | None = None) -> dict:
    """A `tokens`-long prompt through a small all-delta model, against the same model at `reference_tokens`:
    wall time, tokens/s and peak RSS. Each length runs in its own fresh process (spawned by this one), so each
    peak RSS is that prompt's alone: model, inputs and every temporary."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    shape = LONG_MODEL_SHAPE if shape is None else shape
    rows = []
    for length in (reference_tokens, tokens):
        queue = context.Queue()
        child = context.Process(target=_long_prompt_child, args=(length, str(dtype).removeprefix("torch."),
                                                                torch.get_num_threads(), shape, piece_size, queue))
        child.start()
        row = None
        while row is None:
            try:
                row = queue.get(timeout=1.0)
            except Exception:  # queue.Empty: still running, unless the child died
                if not child.is_alive():
                    raise RuntimeError(f"the long-prompt run of {length} tokens failed (exit code {child.exitcode})")
        child.join()
        rows.append(row)
        log(f"long prompt {length:8d} tokens: {row['seconds']:7.1f} s, {row['tokens_per_second']:8.0f} tokens/s, "
            f"peak RSS {row['peak_rss_bytes'] / 2**20:.0f} MiB (+{row['rss_increase_bytes'] / 2**20:.0f} MiB during "
            f"the call)")
    return {"model": shape, "piece_size": rows[0]["piece_size"], "rows": rows,
            "peak_rss_ratio": rows[1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"],
            "measured": "each length in a fresh process: its RSS sampled every 5 ms (model, inputs, temporaries)"}
