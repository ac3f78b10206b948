"""generate() on transformers' own caches: greedy, sampling, beam search, left padding, static cache, continuation."""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from conftest import HYBRID_LAYERS, tiny_delta_model
from delta_attention.modeling.delta_cache import DeltaLinearAttentionLayer
from recording import record_decoder_calls

LAYOUTS = {"all_delta": ["linear_attention"] * 3, "hybrid": HYBRID_LAYERS}


def build(layout, **overrides):
    model = tiny_delta_model(
        seed=7, num_hidden_layers=len(LAYOUTS[layout]), layer_types=LAYOUTS[layout], sliding_window=6, **overrides
    )
    # sharpen the random model so greedy choices are not near-ties between cached and uncached numerics
    model.lm_head.weight.data *= 8
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return model


def prompt(batch=1, length=9, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_greedy_with_cache_equals_recomputing_without(layout, gate):
    model = build(layout, linear_gate=gate)
    input_ids = prompt(batch=2)
    cached = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    uncached = model.generate(input_ids, max_new_tokens=12, do_sample=False, use_cache=False)
    assert cached.shape == (2, 21)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_beam_search_equals_its_no_cache_run(layout, monkeypatch):
    model = build(layout)
    input_ids = prompt(batch=2, seed=1)
    kwargs = dict(max_new_tokens=8, num_beams=3, do_sample=False, num_return_sequences=3, early_stopping=True)
    reorders, reorder = [], DeltaLinearAttentionLayer.reorder_cache

    def spy(layer, beam_idx):
        reorders.append(beam_idx.clone())
        return reorder(layer, beam_idx)

    monkeypatch.setattr(DeltaLinearAttentionLayer, "reorder_cache", spy)
    cached = model.generate(input_ids, **kwargs)
    uncached = model.generate(input_ids, use_cache=False, **kwargs)
    assert cached.shape == (6, 17)
    assert torch.equal(cached, uncached)
    # the delta states really were reordered: some step moved beams, not only kept them in place
    assert any(not torch.equal(beam_idx, torch.arange(6)) for beam_idx in reorders)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_left_padded_batch_matches_each_prompt_alone(layout):
    model = build(layout)
    prompts = [prompt(length=n, seed=n)[0] for n in (5, 11, 8)]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(3, width, dtype=torch.long)
    attention_mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = p
        attention_mask[row, width - len(p) :] = 1
    batched = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=10, do_sample=False)
        assert torch.equal(batched[row, width:], alone[0, len(p) :]), f"row {row}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_static_cache_gives_the_same_tokens_as_dynamic(layout):
    model = build(layout)
    input_ids = prompt(batch=2, seed=3)
    dynamic = model.generate(input_ids, max_new_tokens=10, do_sample=False)
    static = model.generate(input_ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
    assert torch.equal(dynamic, static)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_continuing_from_a_returned_cache(layout):
    model = build(layout)
    input_ids = prompt(seed=4)
    straight = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    first = model.generate(input_ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    # pass the whole sequence so far with the cache: generate feeds only the tokens the cache has not seen
    continued = model.generate(first.sequences, cache=first.cache, max_new_tokens=7, do_sample=False)
    assert torch.equal(continued, straight)


def test_sampling_is_reproducible_and_uses_the_cache():
    model = build("hybrid")
    input_ids = prompt(batch=2, seed=5)
    seen = record_decoder_calls(model)
    torch.manual_seed(11)
    first = model.generate(input_ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9,
                           return_dict_in_generate=True)
    assert seen == [9] + [1] * 9  # the prompt, then one new token per step: the rest comes from the cache
    assert first.cache.get_seq_length() == 18
    first = first.sequences
    torch.manual_seed(11)
    again = model.generate(input_ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(11)
    uncached = model.generate(input_ids, max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, use_cache=False)
    assert torch.equal(first, again) and torch.equal(first, uncached)


def test_generate_with_an_explicit_dynamic_cache():
    model = build("all_delta")
    input_ids = prompt(seed=6)
    cache = DynamicCache(config=model.config)
    out = model.generate(input_ids, cache=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, model.generate(input_ids, max_new_tokens=4, do_sample=False))
    assert cache.layers[0].recurrent_states[0].shape == (1, 4, 16, 16)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_long_prompts_are_prefilled_in_pieces(layout, cache_implementation):
    model = build(layout)
    input_ids = prompt(batch=2, length=70, seed=8)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :9] = 0  # left padding
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                  cache_implementation=cache_implementation)
    model.prefill_piece_size = 0
    one_shot = model.generate(input_ids, **kwargs)
    model.prefill_piece_size = 16
    seen = record_decoder_calls(model)
    pieces = model.generate(input_ids, **kwargs)
    assert torch.equal(pieces, one_shot)
    assert seen[:5] == [16, 16, 16, 16, 6] and max(seen) == 16  # 64 tokens through `prefill`, then the usual step


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_continuing_a_cache_with_a_long_addition_in_pieces(layout):
    model = build(layout)
    first = model.generate(prompt(seed=9), max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    # 12 tokens so far, of which the cache holds 11 (the last generated one has not been through the model)
    longer = torch.cat([first.sequences, prompt(length=40, seed=10)], dim=1)
    model.prefill_piece_size = 0
    straight = model.generate(longer, max_new_tokens=5, do_sample=False)
    model.prefill_piece_size = 16
    seen = record_decoder_calls(model)
    continued = model.generate(longer, cache=first.cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(continued, straight)
    assert seen[:3] == [16, 16, 9]  # only the 41 new tokens: two pieces, then the last 9 as usual


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generate_returns_a_cache_that_knows_its_length(layout):
    model = build(layout)
    out = model.generate(prompt(seed=11), max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    # the last generated token has not been through the model yet
    assert out.cache.get_seq_length() == out.sequences.shape[1] - 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_transformers_chunked_prefill_works_on_delta_caches(layout):
    # an explicit `prefill_chunk_size` is transformers' own path, which asks the cache for `get_seq_length()`
    model = build(layout)
    input_ids = prompt(batch=2, length=70, seed=8)
    model.prefill_piece_size = 0
    one_shot = model.generate(input_ids, max_new_tokens=5, do_sample=False)
    seen = record_decoder_calls(model)
    chunked = model.generate(input_ids, max_new_tokens=5, do_sample=False, prefill_chunk_size=16,
                             return_dict_in_generate=True)
    assert seen == [16, 16, 16, 16, 6, 1, 1, 1, 1]  # the prompt in chunks of 16, then one token per step
    assert torch.equal(chunked.sequences, one_shot)
    assert chunked.cache.get_seq_length() == 74  # 70 prompt tokens and 4 generated ones (the last is not fed)
