"""Rolling delta states back: `cache.crop(-n)` after a recorded block equals a run that only saw the tokens kept
(every gate, conv on/off, hybrids with full and sliding layers, a GQA-shared state), the `max_rollback` bound, no
recording costs when not recording; assisted and prompt-lookup `generate` equal greedy decoding; a deep-copied
prefix cache equals running the whole prompt."""

import copy

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from conftest import HYBRID_LAYERS, tiny_delta_model
from delta_attention.modeling.delta_cache import DeltaCache, DeltaLinearAttentionLayer, cached_length
from recording import record_decoder_calls

# the states and conv windows after a crop are replayed one token at a time (the run they are compared with used the
# chunked kernel): float32 rounding only
STATE_TOLERANCE = 1e-5
LOGIT_TOLERANCE = 1e-4

LAYOUTS = {"all_delta": ["linear_attention"] * 3, "hybrid": HYBRID_LAYERS}
# (layout, gate, conv kernel, state sharing): every gate with the conv on and off, hybrids, a GQA-shared state
ROLLBACK_CASES = [("all_delta", gate, conv, "head") for gate in ("none", "scalar", "channel") for conv in (4, 0)] + [
    ("hybrid", "scalar", 4, "head"), ("hybrid", "channel", 0, "head"), ("hybrid", "channel", 4, "kv_head")]


def build(layout, seed=7, **overrides):
    model = tiny_delta_model(seed=seed, num_hidden_layers=len(LAYOUTS[layout]), layer_types=LAYOUTS[layout],
                             sliding_window=6, **overrides)
    model.lm_head.weight.data *= 8  # sharper choices: greedy tokens are not near-ties between kernels
    model.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return model


def tokens(length, batch=1, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def delta_layers(cache):
    return [layer for layer in cache.layers if isinstance(layer, DeltaLinearAttentionLayer)]


def assert_same_delta_past(cache, reference):
    """Equal token counts, recurrent states and conv windows (same shape: no recorded inputs left over)."""
    assert cached_length(cache) == cached_length(reference)
    for layer, expected in zip(delta_layers(cache), delta_layers(reference), strict=True):
        assert layer.get_seq_length() == expected.get_seq_length()
        assert (layer.recurrent_states[0] - expected.recurrent_states[0]).abs().max() <= STATE_TOLERANCE
        if expected.is_conv_states_initialized[0]:
            assert layer.conv_states[0].shape == expected.conv_states[0].shape
            assert (layer.conv_states[0] - expected.conv_states[0]).abs().max() <= STATE_TOLERANCE


@torch.no_grad()
def assert_continues_alike(model, cache, reference, after):
    got, expected = model(after, cache=cache).logits, model(after, cache=reference).logits
    assert (got - expected).abs().max() <= LOGIT_TOLERANCE


@pytest.mark.parametrize(("layout", "gate", "conv", "sharing"), ROLLBACK_CASES)
@torch.no_grad()
def test_crop_after_k_of_a_verified_block_equals_a_run_that_saw_only_those(layout, gate, conv, sharing):
    model = build(layout, linear_gate=gate, linear_conv_kernel_size=conv, linear_state_sharing=sharing)
    ids = tokens(10 + 6 + 3, batch=2, seed=1)
    prompt, block, after = ids[:, :10], ids[:, 10:16], ids[:, 16:]  # 10 > sliding window 6: the window is full
    base = model(prompt, use_cache=True).cache
    for kept in range(block.shape[1] + 1):
        cache = copy.deepcopy(base)
        cache.activate_past_recording()
        model(block, cache=cache)
        cache.crop(-(block.shape[1] - kept))
        reference = model(torch.cat([prompt, block[:, :kept]], 1), use_cache=True).cache  # never saw the rest
        assert cache.get_seq_length() == 10 + kept
        assert_same_delta_past(cache, reference)
        assert all(layer.recorded is None for layer in delta_layers(cache))  # the record ends with the crop
        assert_continues_alike(model, cache, reference, after)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@torch.no_grad()
def test_crop_reaches_back_over_several_recorded_forwards(layout):
    # a draft model's pattern: its prompt, then one token per step, then the rejected tail is cropped
    model = build(layout)
    ids = tokens(8 + 5 + 2, seed=2)
    cache = DeltaCache(config=model.config)
    cache.activate_past_recording()
    model(ids[:, :8], cache=cache)
    for step in range(8, 13):
        model(ids[:, step : step + 1], cache=cache)
    cache.crop(-3)
    reference = model(ids[:, :10], use_cache=True).cache
    assert_same_delta_past(cache, reference)
    assert_continues_alike(model, cache, reference, ids[:, 13:])


@torch.no_grad()
def test_max_rollback_bounds_the_record_and_a_crop_beyond_it_is_refused():
    model = build("all_delta")
    ids = tokens(20, seed=3)
    cache = DeltaCache(config=model.config, max_rollback=4)
    cache.activate_past_recording()
    model(ids[:, :10], cache=cache)  # a block longer than the bound: only its last 4 tokens are recorded
    assert {layer.recorded.num_tokens for layer in delta_layers(cache)} == {4}
    assert {layer.conv_states[0].shape[-1] for layer in delta_layers(cache)} == {4 + 4}  # kernel + bound
    for start in (10, 13, 16):  # three more blocks of 3: the oldest recorded tokens are folded into the state
        model(ids[:, start : start + 3], cache=cache)
    assert {layer.recorded.num_tokens for layer in delta_layers(cache)} == {4}
    twin = copy.deepcopy(cache)
    cache.crop(-4)
    assert_same_delta_past(cache, model(ids[:, :15], use_cache=True).cache)
    with pytest.raises(ValueError, match=r"Cannot remove 5 tokens from a delta layer that recorded 4 since the last "
                                         r"crop .*DeltaCache\(config=model.config, max_rollback=5\)"):
        twin.crop(-5)
    twin.crop(-4)  # the refused crop changed nothing
    assert_same_delta_past(twin, cache)


@torch.no_grad()
def test_no_record_without_recording_and_no_crop_of_tokens_it_did_not_record():
    model = build("all_delta")
    ids = tokens(12, seed=4)
    cache = model(ids[:, :8], use_cache=True).cache
    model(ids[:, 8:], cache=cache)
    for layer in delta_layers(cache):  # nothing kept beyond the state and a conv window of the kernel's width
        assert layer.recorded is None and not layer.record_past and layer.conv_states[0].shape[-1] == 4
    with pytest.raises(RuntimeError, match="does not record its past; call `cache.activate_past_recording\\(\\)`"):
        cache.crop(-1)
    cache.activate_past_recording()
    with pytest.raises(ValueError, match="Cannot remove 1 tokens from a delta layer that recorded 0"):
        cache.crop(-1)


@torch.no_grad()
def test_a_padded_block_while_recording_is_refused():
    model = build("all_delta")
    ids = tokens(6, batch=2, seed=4)
    cache = model(ids, use_cache=True).cache
    cache.activate_past_recording()
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 6:8] = 0
    with pytest.raises(ValueError, match="rollback needs unpadded rows: pass batches without padding there"):
        model(tokens(6, batch=2, seed=5), attention_mask=attention_mask, cache=cache)


def spy_on_crops(monkeypatch):
    """Record (cache, tokens removed) of every `DeltaCache.crop` call."""
    crops, crop = [], DeltaCache.crop

    def spy(cache, tokens_to_remove):
        crops.append((cache, -tokens_to_remove))
        return crop(cache, tokens_to_remove)

    monkeypatch.setattr(DeltaCache, "crop", spy)
    return crops


def grounded_prompt(model, seed):
    """A prompt whose continuation copies from it: a seed text, the model's own greedy continuation of it, and the
    seed again (prompt lookup then proposes drafts, some of which the model keeps). Without the pad id 0 (a
    generated pad would make transformers mask it)."""
    start = tokens(6, seed=seed)
    text = model.generate(start, max_new_tokens=24, do_sample=False)
    return torch.cat([text, start], 1).clamp(min=3)


def assert_some_drafts_kept_and_some_rejected(crops, cache, blocks):
    """`blocks`: the target's decoder calls (token counts); after the first, each verifies a draft of n - 1 tokens
    and is followed by one crop of the cache removing the rejected ones."""
    removed = [n for crop_cache, n in crops if crop_cache is cache]
    assert len(removed) == len(blocks)
    drafted = [0] + [n - 1 for n in blocks[1:]]  # the first block is the prompt and its draft
    assert any(r > 0 for r in removed), "no draft token was rejected: the rollback is not exercised"
    assert any(d - r > 0 for d, r in zip(drafted[1:], removed[1:])), "no draft token was kept"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prompt_lookup_decoding_gives_the_greedy_tokens(layout, monkeypatch):
    model = build(layout)
    prompt = grounded_prompt(model, seed=4)
    greedy = model.generate(prompt, max_new_tokens=24, do_sample=False)
    crops = spy_on_crops(monkeypatch)
    blocks = record_decoder_calls(model)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=5,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy)
    assert len(blocks) < 24  # drafts kept: fewer forward passes than tokens
    assert_some_drafts_kept_and_some_rejected(crops, out.cache, blocks)
    assert not any(layer.record_past for layer in delta_layers(out.cache))  # the returned cache records no more


def test_generate_makes_room_to_roll_back_a_long_draft():
    model = build("all_delta")
    out = model.generate(tokens(9, seed=6), max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=40,
                         return_dict_in_generate=True)
    assert out.cache.max_rollback == 40
    assert model.generate(tokens(9, seed=6), max_new_tokens=1, return_dict_in_generate=True).cache.max_rollback == 32


def draft_for(target, layout):
    """An all-delta draft model that agrees with the target often but not always: the target's delta layers (and
    embeddings, norm and head), its softmax layers left out, each weight perturbed by about 10%."""
    delta = [i for i, kind in enumerate(LAYOUTS[layout]) if kind == "linear_attention"]
    draft = tiny_delta_model(seed=3, num_hidden_layers=len(delta))
    draft.generation_config = GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=None,
                                               num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    for mine, theirs in zip(draft.model.layers, delta):
        mine.load_state_dict(target.model.layers[theirs].state_dict())
    with torch.no_grad():
        for parameter in draft.model.layers.parameters():
            parameter.mul_(1 + 0.1 * torch.randn_like(parameter))
    return draft


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_assisted_decoding_with_a_delta_draft_gives_the_greedy_tokens(layout, monkeypatch):
    model = build(layout)
    draft = draft_for(model, layout)
    prompt = tokens(9, seed=6)
    greedy = model.generate(prompt, max_new_tokens=24, do_sample=False)
    crops = spy_on_crops(monkeypatch)
    blocks = record_decoder_calls(model)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=draft,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy)
    assert_some_drafts_kept_and_some_rejected(crops, out.cache, blocks)
    draft_crops = [n for cache, n in crops if cache is not out.cache]
    assert any(n > 0 for n in draft_crops)  # the draft's own delta states were rolled back too


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_deep_copied_prefix_cache_gives_the_whole_prompts_output(layout):
    # transformers' prompt-reuse pattern: prefill a shared prefix once, deep-copy the cache for each request
    model = build(layout)
    prefix = tokens(11, seed=7)
    prefix_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefix_cache = model(prefix, cache=prefix_cache).cache
    for length, seed in ((1, 8), (5, 9), (13, 10)):
        prompt = torch.cat([prefix, tokens(length, seed=seed)], 1)
        whole = model.generate(prompt, max_new_tokens=10, do_sample=False)
        reused = model.generate(prompt, cache=copy.deepcopy(prefix_cache), max_new_tokens=10, do_sample=False)
        assert torch.equal(reused, whole)
    assert cached_length(prefix_cache) == 11  # the shared prefix is untouched
    with torch.no_grad():  # and still continues like the prefix run alone
        again = model(prefix, use_cache=True).cache
    assert_same_delta_past(prefix_cache, again)
