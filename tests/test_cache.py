"""Delta layers' cache entries count their tokens: `get_seq_length()` on all-delta and hybrid caches, plain
transformers caches taken over, conv-less layers that know they hold a state, reset, deep copy, static caches."""

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from conftest import HYBRID_LAYERS, tiny_delta_model
from delta_attention.modeling.delta_cache import (
    DeltaCache,
    DeltaLinearAttentionLayer,
    cached_length,
    use_delta_layers,
)

LAYOUTS = {"all_delta": ["linear_attention"] * 3, "hybrid": HYBRID_LAYERS}


def build(layout, **overrides):
    return tiny_delta_model(num_hidden_layers=len(LAYOUTS[layout]), layer_types=LAYOUTS[layout], sliding_window=6,
                            **overrides)


def delta_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, DeltaLinearAttentionLayer)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("conv", [4, 0])
def test_the_models_cache_counts_its_tokens(layout, conv):
    model = build(layout, linear_conv_kernel_size=conv)
    ids = torch.randint(3, 97, (2, 13))
    with torch.no_grad():
        cache = model(ids[:, :10], use_cache=True).cache
        assert type(cache) is DeltaCache and cache.get_seq_length() == cached_length(cache) == 10
        model(ids[:, 10:], cache=cache)
    assert cache.get_seq_length() == 13
    assert all(layer.get_seq_length() == 13 and layer.has_previous_state[0] for layer in delta_layers(cache))
    if layout == "hybrid":  # every layer agrees, attention layers included
        assert {cache.get_seq_length(i) for i in range(len(cache.layers))} == {13}
    cache.reset()
    assert cache.get_seq_length() == 0 and not any(layer.has_previous_state[0] for layer in delta_layers(cache))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plain_transformers_caches_are_taken_over(layout):
    model = build(layout)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        full = model(ids).logits
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=16)):
            assert cached_length(cache) == 0
            first = model(ids[:, :7], cache=cache)
            assert len(delta_layers(cache)) == LAYOUTS[layout].count("linear_attention")
            assert cached_length(cache) == 7
            rest = model(ids[:, 7:], cache=cache)
            assert cached_length(cache) == 12
            assert (torch.cat([first.logits, rest.logits], 1) - full).abs().max() <= 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_deep_copy_continues_on_its_own(layout):
    model = build(layout)
    ids = torch.randint(3, 97, (1, 10))
    with torch.no_grad():
        cache = model(ids[:, :8], use_cache=True).cache
        twin = copy.deepcopy(cache)
        a = model(ids[:, 8:], cache=cache).logits
        b = model(ids[:, 8:], cache=twin).logits
    assert torch.equal(a, b) and cache.get_seq_length() == twin.get_seq_length() == 10
    assert all(x.recurrent_states[0] is not y.recurrent_states[0] for x, y in zip(delta_layers(cache),
                                                                                  delta_layers(twin)))


def test_a_layer_filled_elsewhere_keeps_its_states():
    cache = DynamicCache(config=build("all_delta").config)
    cache.update_recurrent_state(torch.randn(1, 4, 16, 16), 0)
    cache.layers[0].has_previous_state[0] = True  # as code filling a cache by hand would
    held = cache.layers[0].recurrent_states[0]
    use_delta_layers(cache)
    layer = cache.layers[0]
    assert isinstance(layer, DeltaLinearAttentionLayer) and layer.recurrent_states[0] is held
    assert layer.has_previous_state[0] and layer.get_seq_length() == 0  # its count starts here
