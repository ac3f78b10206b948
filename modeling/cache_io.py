"""Saved states: a filled cache written to one safetensors file and read back, checked against the model.

A delta layer carries its whole past in a fixed-size state (the recurrent state `S` and the short conv's window),
a few MB whatever the context, so a long document can be read once, its state saved, and every later question
continued from the file (docs/design.md, "Saved states"). Softmax layers of a hybrid are saved too: their keys and
values (the last `sliding_window - 1` of a sliding layer), which do grow with the context.

A state file holds, per layer `i`:

- delta layer: `layers.i.recurrent_state` [B, Hs, K, V] (float32; Hs states, one per delta head unless the config
  shares them per KV head) and, with a short conv, `layers.i.conv_window` [B, H*K + Hs*(K + V), kernel] (activation
  dtype: the last inputs of the conv over the [q | k | v] channels);
- softmax layer: `layers.i.keys` and `layers.i.values` [B, H_kv, T, d] (T capped at `sliding_window - 1` for a
  sliding layer);

and metadata (strings): the format and its version, the token count, the batch size, the activation dtype, the
model type and layer types, the shape fields, the model's configuration with its fingerprint, and a fingerprint of
the weights when the state was saved from a model. `load_cache` refuses, with one line naming the difference, a
file whose state another model computed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .configuration_delta import DELTA_LAYER, FULL_ATTENTION_LAYER, DeltaConfig
from .delta_cache import DeltaCache, DeltaLinearAttentionLayer

STATE_FORMAT = "delta-attention-state"
STATE_FORMAT_VERSION = 1

#: config fields the shapes of a state depend on (checked one by one, for a precise message)
SHAPE_FIELDS = ("num_hidden_layers", "linear_num_heads", "linear_num_state_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_size", "num_key_value_heads", "head_dim", "sliding_window")
#: `DeltaConfig` fields that change neither what a state holds nor how it is continued (left out of the fingerprint)
UNFINGERPRINTED_FIELDS = ("use_cache", "initializer_range", "pad_token_id", "bos_token_id", "eos_token_id",
                          "attention_dropout", "linear_chunk_size")


class StateMismatchError(ValueError):
    """A state file that was not saved from this model (another architecture, configuration, dtype or weights)."""


def _split(model_or_config):
    """(model or None, config) of a `DeltaForCausalLM`/`DeltaModel` or a `DeltaConfig`."""
    config = getattr(model_or_config, "config", model_or_config)
    model = model_or_config if config is not model_or_config else None
    if getattr(config, "model_type", None) != DeltaConfig.model_type:
        raise StateMismatchError(
            f"state files hold delta-attention caches; this is a {getattr(config, 'model_type', type(config).__name__)}"
            " model: pass the delta model (or its config) the state belongs to"
        )
    return model, config


def _shape_fields(config) -> dict:
    """`SHAPE_FIELDS` of `config` (delta states per layer: one per delta head unless the config shares them)."""
    fields = {name: getattr(config, name, None) for name in SHAPE_FIELDS}
    if fields["linear_num_state_heads"] is None:
        fields["linear_num_state_heads"] = config.linear_num_heads
    return fields


def fingerprinted_config(config) -> dict:
    """The configuration fields a state depends on: every `DeltaConfig` field but `UNFINGERPRINTED_FIELDS`."""
    return {name: getattr(config, name, None) for name in DeltaConfig.__annotations__
            if name not in UNFINGERPRINTED_FIELDS}


def config_fingerprint(config) -> str:
    """A short hash of `fingerprinted_config(config)`."""
    text = json.dumps(fingerprinted_config(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@torch.no_grad()
def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of every weight's name, shape and 24 of its values (first, middle, last 8): milliseconds,
    yet another training run, a merged adapter or another seed changes it."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        middle = flat.numel() // 2
        sample = torch.cat([flat[:8], flat[middle : middle + 8], flat[-8:]]).float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def state_tensor_shapes(config, tokens: int = 0, batch_size: int = 1) -> dict[str, tuple[int, ...]]:
    """The tensors a state file of `config` holds after `tokens` tokens, by name: their shapes."""
    fields = _shape_fields(config)
    heads, states = fields["linear_num_heads"], fields["linear_num_state_heads"]
    key_dim, value_dim, kernel = fields["linear_key_head_dim"], fields["linear_value_head_dim"], fields[
        "linear_conv_kernel_size"]
    shapes = {}
    for index, kind in enumerate(config.layer_types):
        prefix = f"layers.{index}."
        if kind == DELTA_LAYER:
            shapes[prefix + "recurrent_state"] = (batch_size, states, key_dim, value_dim)
            if kernel:  # the [q | k | v] channels: queries per head, keys and values per state
                shapes[prefix + "conv_window"] = (batch_size, heads * key_dim + states * (key_dim + value_dim), kernel)
        else:
            kept = tokens if kind == FULL_ATTENTION_LAYER else min(tokens, config.sliding_window - 1)
            shapes[prefix + "keys"] = shapes[prefix + "values"] = (
                batch_size, config.num_key_value_heads, kept, config.head_dim)
    return shapes


def state_bytes(config, tokens: int = 0, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the tensors of a state file (`state_tensor_shapes`): float32 recurrent states, the rest in `dtype`."""
    total = 0
    for name, shape in state_tensor_shapes(config, tokens, batch_size).items():
        width = 4 if name.endswith("recurrent_state") else torch.empty((), dtype=dtype).element_size()
        total += width * math.prod(shape)
    return total


def _cache_tensors(cache: Cache, config) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a filled cache by file name, and the token count all its layers agree on."""
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(f"the cache has {len(cache.layers)} layers and the model {config.num_hidden_layers}: "
                         "save a cache this model filled")
    tensors, counts = {}, set()
    for index, (layer, kind) in enumerate(zip(cache.layers, config.layer_types)):
        prefix = f"layers.{index}."
        if kind == DELTA_LAYER:
            if not isinstance(layer, DeltaLinearAttentionLayer) or not layer.is_recurrent_states_initialized[0]:
                raise ValueError("the cache holds no tokens yet: run the model on a prompt with it before saving")
            tensors[prefix + "recurrent_state"] = layer.recurrent_states[0]
            if config.linear_conv_kernel_size:  # the last `kernel` inputs (more are kept while a draft is verified)
                tensors[prefix + "conv_window"] = layer.conv_states[0][..., -config.linear_conv_kernel_size :]
            counts.add(layer.get_seq_length())
            continue
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise ValueError(f"save_cache saves the dynamic caches the model creates (DeltaCache, DynamicCache); layer "
                             f"{index} is a {type(layer).__name__}: generate with the default cache to save its state")
        if not layer.is_initialized:
            raise ValueError("the cache holds no tokens yet: run the model on a prompt with it before saving")
        keys, values = layer.keys, layer.values
        if kind != FULL_ATTENTION_LAYER:  # sliding: the last window - 1 keys are all a later token can see
            kept = min(keys.shape[-2], config.sliding_window - 1)
            keys, values = keys[..., keys.shape[-2] - kept :, :], values[..., values.shape[-2] - kept :, :]
        tensors[prefix + "keys"], tensors[prefix + "values"] = keys, values
        counts.add(layer.get_seq_length())
    if len(counts) != 1:
        raise ValueError(f"the layers of this cache hold different token counts {sorted(counts)}: save a cache that "
                         "one model filled")
    return tensors, counts.pop()


def save_cache(cache: Cache, path: str | os.PathLike, model_or_config) -> Path:
    """Write the state in `cache` (filled by `model_or_config`'s model) to the safetensors file `path`.

    Pass the model to record a fingerprint of its weights too (checked when the file is loaded with a model). The
    file is written under a temporary name and renamed when complete. Returns the path."""
    from safetensors.torch import save_file

    model, config = _split(model_or_config)
    tensors, tokens = _cache_tensors(cache, config)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    activations = [t for name, t in tensors.items() if not name.endswith("recurrent_state")]
    dtype = model.dtype if model is not None else (activations[0].dtype if activations else torch.float32)
    metadata = {
        "format": STATE_FORMAT,
        "format_version": str(STATE_FORMAT_VERSION),
        "tokens": str(tokens),
        "batch_size": str(next(iter(tensors.values())).shape[0]),
        "dtype": _dtype_name(dtype),
        "model_type": config.model_type,
        "layer_types": json.dumps(list(config.layer_types)),
        "shapes": json.dumps(_shape_fields(config)),
        "config": json.dumps(fingerprinted_config(config), sort_keys=True, default=str),
        "config_fingerprint": config_fingerprint(config),
    }
    if model is not None:
        metadata["weights_fingerprint"] = weights_fingerprint(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        save_file(tensors, partial, metadata=metadata)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def state_file_info(path: str | os.PathLike) -> dict:
    """The metadata of a state file (tokens and batch size as ints, layer types, shapes and config decoded), read
    without loading its tensors. Raises a one-line error for a missing file or one that is not a state file."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"state file {path}: no such file")
    try:
        with safe_open(path, "pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise StateMismatchError(f"state file {path} is not a safetensors file ({first_line})") from None
    if metadata.get("format") != STATE_FORMAT:
        raise StateMismatchError(f"state file {path} is not a delta-attention state file (its metadata has no "
                                 f"format '{STATE_FORMAT}'): write one with save_cache")
    if int(metadata.get("format_version", 0)) > STATE_FORMAT_VERSION:
        raise StateMismatchError(f"state file {path} has format version {metadata['format_version']}; this version of "
                                 f"delta-attention reads up to {STATE_FORMAT_VERSION}: update delta-attention")
    info = dict(metadata)
    for key in ("tokens", "batch_size", "format_version"):
        info[key] = int(metadata[key])
    for key in ("layer_types", "shapes", "config"):
        info[key] = json.loads(metadata[key])
    return info


def _describe_layer_types(layer_types: list[str]) -> str:
    counts = {kind: layer_types.count(kind) for kind in dict.fromkeys(layer_types)}
    return f"{len(layer_types)} layers (" + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ")"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_state_matches(info: dict, model_or_config, path: str | os.PathLike = "") -> None:
    """Raise `StateMismatchError` (one line, naming the first difference) unless the state file described by `info`
    (`state_file_info`) was saved from this model: layer types, shapes, dtype, configuration and, when both the
    file and the call have a model, its weights."""
    model, config = _split(model_or_config)
    where = f"state file {path}" if str(path) else "the state file"
    saved_from = f"{where} was saved from a model with"
    fix = "load it with the model it was saved from"
    saved_types, types = info["layer_types"], list(config.layer_types)
    if saved_types != types:
        common = min(len(saved_types), len(types))
        first = next((i for i in range(common) if saved_types[i] != types[i]), common)
        detail = (f"layer {first} is {saved_types[first]} there and {types[first]} here" if first < common
                  else "the layer counts differ")
        raise StateMismatchError(f"{saved_from} {_describe_layer_types(saved_types)}; this model has "
                                 f"{_describe_layer_types(types)} ({detail}): {fix}")
    for name, value in _shape_fields(config).items():
        if info["shapes"].get(name) != value:
            raise StateMismatchError(f"{saved_from} {name}={info['shapes'].get(name)}; this model has {name}={value}: "
                                     f"{fix}")
    if model is not None and info["dtype"] != _dtype_name(model.dtype):
        raise StateMismatchError(f"{where} was saved from a {info['dtype']} model; this model is "
                                 f"{_dtype_name(model.dtype)}: load the model with dtype=torch.{info['dtype']}")
    if info["config_fingerprint"] != config_fingerprint(config):
        ours, theirs = json.loads(json.dumps(fingerprinted_config(config), default=str)), info["config"]
        differing = [name for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)]
        detail = ", ".join(f"{name} {theirs.get(name)!r} there, {ours.get(name)!r} here" for name in differing[:3])
        raise StateMismatchError(f"{saved_from} another configuration ({detail or 'fingerprint'}): {fix}")
    if model is not None and info.get("weights_fingerprint") not in (None, weights_fingerprint(model)):
        raise StateMismatchError(f"{saved_from} the same configuration but other weights (weights fingerprint "
                                 f"{info['weights_fingerprint']}, this model {weights_fingerprint(model)}): {fix}")


def load_cache(path: str | os.PathLike, model_or_config, device: str | torch.device | None = None) -> DeltaCache:
    """A `DeltaCache` holding the state saved in `path`, to continue with the model (`model(ids, cache=...)` or
    `generate(all_ids, cache=...)`, where `all_ids` starts with the tokens the state has read).

    The file is checked against `model_or_config` first (`check_state_matches`): a state another model computed
    raises `StateMismatchError`. Tensors go to `device` (default: the model's device, or CPU for a config)."""
    from safetensors import safe_open

    model, config = _split(model_or_config)
    info = state_file_info(path)
    check_state_matches(info, model_or_config, path)
    if device is None:
        device = model.device if model is not None else "cpu"
    expected = state_tensor_shapes(config, info["tokens"], info["batch_size"])
    with safe_open(Path(path), "pt", device=str(device)) as handle:
        names = set(handle.keys())
        if names != set(expected):
            missing = sorted(set(expected) - names) or sorted(names - set(expected))
            raise StateMismatchError(f"state file {path} is damaged: its tensors do not match its metadata "
                                     f"({missing[0]} {'missing' if missing[0] in expected else 'unexpected'})")
        tensors = {name: handle.get_tensor(name) for name in names}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise StateMismatchError(f"state file {path} is damaged: {name} has shape {tuple(tensor.shape)}, its "
                                     f"metadata says {expected[name]}")

    cache, tokens = DeltaCache(config=config), info["tokens"]
    for index, kind in enumerate(config.layer_types):
        prefix = f"layers.{index}."
        if kind == DELTA_LAYER:
            if config.linear_conv_kernel_size:
                cache.update_conv_state(tensors[prefix + "conv_window"], index,
                                        conv_kernel_size=config.linear_conv_kernel_size)
            cache.update_recurrent_state(tensors[prefix + "recurrent_state"], index, new_tokens=tokens)
        else:
            cache.update(tensors[prefix + "keys"], tensors[prefix + "values"], index)
            if kind != FULL_ATTENTION_LAYER:  # a sliding layer counts every token seen, not only the kept ones
                cache.layers[index].cumulative_length = tokens
    return cache


__all__ = ["StateMismatchError", "check_state_matches", "load_cache", "save_cache", "state_bytes", "state_file_info",
           "state_tensor_shapes"]
