"""The fast inference paths of a delta layer (`FusedLinear` input projection, `DeltaAttention._inference_step`) against
the reference path (`DeltaAttention.fast_inference = False`): equal outputs and cache states, float32 states in
bf16 models, never a stale fused weight, and checkpoints that do not change.

Tolerances: float32 logits and states within 1e-5 (absolute) of the reference; a bf16 model's logits within 0.05 of
the float32 model's (logits of about unit size; bf16 keeps 8 bits of mantissa, about 4e-3 relative per op)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from conftest import HYBRID_LAYERS, prefill_then_decode, tiny_delta_model
from delta_attention import DeltaForCausalLM
from delta_attention.modeling.few_rows_linear import DeltaLinear
from delta_attention.modeling.modeling_delta import DeltaAttention, FusedLinear
from isolated import load_isolated

CLASS_DEFAULT_FUSE = DeltaAttention.fuse_projections  # read before any fixture changes it
FLOAT32_ATOL = 1e-5
BF16_ATOL = 0.05

CONFIGS = {
    "scalar gate": {},
    "channel gate": dict(linear_gate="channel"),
    "no gate, no conv": dict(linear_gate="none", linear_conv_kernel_size=0),
    "GQA-shared state": dict(linear_state_sharing="kv_head"),
    "no output gate, qk norm": dict(linear_output_gate=False, use_qk_norm=True),
    "hybrid": dict(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6),
}


@pytest.fixture(autouse=True)
def fused_projections(monkeypatch):
    """The fused input projection (`DeltaAttention.fuse_projections`, on by default); these tests check it, so it is
    on whatever another test left, unless a test turns it off."""
    monkeypatch.setattr(DeltaAttention, "fuse_projections", True)


@pytest.fixture
def decode_steps(monkeypatch):
    """Counts the calls of the fast decode step (a fast path that silently never runs would pass every test)."""
    calls = []
    step = DeltaAttention._inference_step

    def counted(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DeltaAttention, "_inference_step", counted)
    return calls


def reference_path(model, enabled: bool = False):
    for module in model.modules():
        if isinstance(module, DeltaAttention):
            module.fast_inference = enabled


def states(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (getattr(layer, "recurrent_states", {0: None})[0],
                                                  getattr(layer, "conv_states", {0: None})[0]) if t is not None]


def fused_count(model) -> int:
    return sum(getattr(m, "_fused_inputs", None) is not None for m in model.modules() if isinstance(m, DeltaAttention))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_fast_decode_equals_the_reference_and_the_full_forward(config, decode_steps):
    model = tiny_delta_model(**CONFIGS[config])
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(1))
    full, fast, fast_cache = prefill_then_decode(model, ids, 5)
    delta_layers = len(model.config.delta_layers)
    assert len(decode_steps) == 9 * delta_layers  # every decode step of every delta layer took the fast path
    assert fused_count(model) == delta_layers
    reference_path(model)
    decode_steps.clear()
    _, reference, reference_cache = prefill_then_decode(model, ids, 5)
    assert not decode_steps and fused_count(model) == delta_layers  # (built before; unused now)
    assert (fast - reference).abs().max() <= FLOAT32_ATOL
    assert (fast - full).abs().max() <= FLOAT32_ATOL
    for got, want in zip(states(fast_cache), states(reference_cache), strict=True):
        assert (got - want).abs().max() <= FLOAT32_ATOL
    assert fast_cache.get_seq_length() == reference_cache.get_seq_length() == 14


def test_fast_decode_without_fused_projections(monkeypatch, decode_steps):
    model = tiny_delta_model(linear_gate="channel")
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    _, fused, _ = prefill_then_decode(model, ids, 4)
    monkeypatch.setattr(DeltaAttention, "fuse_projections", False)
    model = tiny_delta_model(linear_gate="channel")
    decode_steps.clear()
    full, unfused, _ = prefill_then_decode(model, ids, 4)
    assert len(decode_steps) == 6 * 3 and fused_count(model) == 0  # the fast step, without fused weights
    assert (unfused - fused).abs().max() <= FLOAT32_ATOL
    assert (unfused - full).abs().max() <= FLOAT32_ATOL


def storage_bytes(model) -> int:
    """The bytes of the distinct memory blocks behind the model's parameters and buffers."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def owns_its_memory(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def test_fused_projections_are_the_default_and_move_the_weights_without_a_copy():
    assert CLASS_DEFAULT_FUSE is True
    model = tiny_delta_model(linear_gate="channel")
    before, names = storage_bytes(model), set(model.state_dict())
    prefill_then_decode(model, torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2)), 2)
    assert fused_count(model) == len(model.config.delta_layers)
    attentions = [m for m in model.modules() if isinstance(m, DeltaAttention)]
    zero_biases = sum(getattr(attention, name).out_features * 4 for attention in attentions
                      for name in attention.input_projections if getattr(attention, name).bias is None)
    assert 0 < zero_biases < 0.01 * before  # the fused bias has zeros where a projection has none: all that is new
    assert storage_bytes(model) == before + zero_biases and set(model.state_dict()) == names  # moved, not copied
    for attention in attentions:
        fused = attention._fused_inputs.weight
        for name in attention.input_projections:
            weight = getattr(attention, name).weight
            assert weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert not owns_its_memory(weight)
    model.train()  # training: every projection in memory of its own again, nothing fused, nothing more
    assert fused_count(model) == 0 and storage_bytes(model) == before
    assert all(owns_its_memory(p) for p in model.parameters())


def test_weights_fused_under_inference_mode_still_train():
    model = tiny_delta_model()
    with torch.inference_mode():  # a prefill and a decode step (any forward without autograd fuses)
        cache = model(IDS[:, :4], use_cache=True).cache
        model(IDS[:, 4:5], cache=cache)
    assert fused_count(model) == len(model.config.delta_layers)
    assert not any(p.is_inference() for p in model.parameters())
    model(IDS, labels=IDS).loss.backward()  # in eval mode, on the views
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.parametrize("config", ["scalar gate", "channel gate", "GQA-shared state"])
def test_bf16_model_runs_bf16_matmuls_with_float32_states(config, decode_steps):
    model = tiny_delta_model(**CONFIGS[config])
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(2))
    _, want, _ = prefill_then_decode(model, ids, 5)
    model.to(torch.bfloat16)
    full, fast, cache = prefill_then_decode(model, ids, 5)
    assert decode_steps and fast.dtype == torch.bfloat16
    assert all(layer.recurrent_states[0].dtype == torch.float32 for layer in cache.layers)
    assert (fast.float() - want).abs().max() <= BF16_ATOL
    assert (fast.float() - full.float()).abs().max() <= BF16_ATOL
    reference_path(model)
    _, reference, _ = prefill_then_decode(model, ids, 5)
    assert (fast.float() - reference.float()).abs().max() <= BF16_ATOL
    reference_path(model, True)  # a verification block: bf16 logits, float32 state, near the float32 model's
    decode_steps.clear()
    with torch.no_grad():
        block = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
    assert len(decode_steps) == len(model.config.delta_layers) and block.dtype == torch.bfloat16
    assert (block.float() - want[:, 8:]).abs().max() <= BF16_ATOL


def decode_logits(model, ids, prefill=4) -> torch.Tensor:
    return prefill_then_decode(model, ids, prefill)[1]


def reference_logits(model, ids, prefill=4) -> torch.Tensor:
    reference_path(model)
    try:
        return decode_logits(model, ids, prefill)
    finally:
        reference_path(model, enabled=True)


IDS = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(3))


def test_fused_weights_follow_load_state_dict_and_in_place_writes():
    model = tiny_delta_model(seed=0)
    decode_logits(model, IDS)  # builds the fused weights
    other = tiny_delta_model(seed=5)
    model.load_state_dict(other.state_dict())
    assert (decode_logits(model, IDS) - decode_logits(other, IDS)).abs().max() <= FLOAT32_ATOL

    model.load_state_dict(tiny_delta_model(seed=6).state_dict(), assign=True)  # new tensors in place of the old
    assert (decode_logits(model, IDS) - reference_logits(model, IDS)).abs().max() <= FLOAT32_ATOL

    attention = model.model.layers[1].self_attn
    with torch.no_grad():
        attention.b_proj.bias.add_(1.0)
    assert (decode_logits(model, IDS) - reference_logits(model, IDS)).abs().max() <= FLOAT32_ATOL
    attention.g_proj.weight.data = attention.g_proj.weight.data * 2  # a new tensor behind the same parameter
    assert (decode_logits(model, IDS) - reference_logits(model, IDS)).abs().max() <= FLOAT32_ATOL


def test_fused_weights_follow_dtype_round_trips_and_optimizer_steps():
    model = tiny_delta_model(seed=0)
    decode_logits(model, IDS)
    model.to(torch.bfloat16)
    decode_logits(model, IDS)
    model.to(torch.float32)  # values now rounded to bf16: the float32 copy fused first must not come back
    assert fused_count(model) == 0
    decode_logits(model, IDS)
    model.to("cpu")  # where it already is: the parameters stay put, and no longer view the dropped fused rows
    assert fused_count(model) == 0 and all(owns_its_memory(p) for p in model.parameters())
    assert (decode_logits(model, IDS) - reference_logits(model, IDS)).abs().max() <= FLOAT32_ATOL

    # an optimizer step in eval mode (no `train()` to drop the fused weights): the version counters tell
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(IDS, labels=IDS).loss.backward()
    optimizer.step()
    assert (decode_logits(model, IDS) - reference_logits(model, IDS)).abs().max() <= FLOAT32_ATOL


def test_fused_weights_are_never_used_with_gradients_or_peft_and_follow_a_lora_merge():
    model = tiny_delta_model(seed=0)
    decode_logits(model, IDS)
    # with gradients on, the projections run one by one: their weights get gradients
    model(IDS, labels=IDS).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert model.model.layers[0].self_attn.b_proj.weight.grad is not None

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "g_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora).eval()
    assert fused_count(model) == 0  # wrapping the projections dropped them
    with torch.no_grad():
        adapted = peft_model(IDS).logits
    assert fused_count(model) == 0  # and wrapped projections are not fused
    merged = peft_model.merge_and_unload()
    assert all(type(m.q_proj) is DeltaLinear for m in merged.modules() if isinstance(m, DeltaAttention))
    with torch.no_grad():
        assert (merged(IDS).logits - adapted).abs().max() <= FLOAT32_ATOL
    assert fused_count(merged) == len(merged.model.layers)
    assert (decode_logits(merged, IDS) - reference_logits(merged, IDS)).abs().max() <= FLOAT32_ATOL


def test_fused_linear_refuses_what_it_cannot_fuse():
    plain = [torch.nn.Linear(8, 4), torch.nn.Linear(8, 3, bias=False)]
    assert FusedLinear.fits(plain)
    fused = FusedLinear(plain)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(fused(x), torch.cat([plain[0](x), plain[1](x)], -1), atol=1e-6)
    assert fused.is_current(plain)
    assert not fused.is_current([plain[0], torch.nn.Linear(8, 3, bias=False)])
    assert not FusedLinear.fits([plain[0], plain[1].to(torch.bfloat16)])
    sharded = torch.nn.Linear(8, 3)
    sharded.weight = torch.nn.Parameter(torch.empty(0))  # a weight held elsewhere (ZeRO-3 outside its forward)
    assert not FusedLinear.fits([plain[0], sharded])

    class Wrapped(torch.nn.Linear):
        pass

    assert not FusedLinear.fits([plain[0], Wrapped(8, 3)])
    wrapped = Wrapped(8, 3, bias=False)
    wrapped.weight = plain[1].weight
    assert not fused.is_current([plain[0], wrapped])  # the same tensors behind a wrapper


def test_a_projection_with_a_forward_hook_is_called_on_its_own():
    model = tiny_delta_model(seed=0)
    want = decode_logits(model, IDS)  # fused
    attention = model.model.layers[0].self_attn
    inputs = []
    hook = attention.b_proj.register_forward_hook(lambda module, args, output: inputs.append(args[0].shape))
    got = decode_logits(model, IDS)
    assert len(inputs) == 2 + 5 and fused_count(model) == len(model.config.delta_layers) - 1  # full, prefill, steps
    assert (got - want).abs().max() <= FLOAT32_ATOL
    hook.remove()
    inputs.clear()
    global_hook = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert (decode_logits(model, IDS) - want).abs().max() <= FLOAT32_ATOL and fused_count(model) == 0
        assert all(owns_its_memory(p) for p in model.parameters())  # unfused: no parameter left on stale rows
    finally:
        global_hook.remove()
    decode_logits(model, IDS)
    assert not inputs and fused_count(model) == len(model.config.delta_layers)


def test_a_fused_model_saves_whole_through_safetensors_and_accelerate(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_model, save_model

    model = tiny_delta_model(seed=0)
    want = decode_logits(model, IDS)
    assert fused_count(model) == len(model.config.delta_layers)
    state = model.state_dict()
    storages = [t.untyped_storage().data_ptr() for t in state.values()]
    tied = model.config.tie_word_embeddings  # the tied embedding and head share one tensor, as in any model
    assert len(set(storages)) == len(storages) - tied  # no other entry shares memory with another
    assert all(isinstance(t, torch.nn.Parameter) for t in model.state_dict(keep_vars=True).values())

    save_model(model, str(tmp_path / "model.safetensors"))  # refused disjoint views of one tensor
    try:
        Accelerator().save_model(model, tmp_path / "accelerate")  # kept one name of each group of shared tensors
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # as the training loop does before its own
    for load in (lambda m: load_model(m, str(tmp_path / "model.safetensors")),
                 lambda m: m.load_state_dict(load_file(tmp_path / "accelerate" / "model.safetensors"), strict=False)):
        other = tiny_delta_model(seed=7)
        load(other)
        assert (decode_logits(other, IDS) - want).abs().max() <= FLOAT32_ATOL
    saved = load_file(tmp_path / "accelerate" / "model.safetensors")
    assert set(state) - set(saved) <= {"lm_head.weight"}  # every projection kept (the tied head: as accelerate does)


def test_a_checkpoint_saved_from_a_fused_model_loads_unchanged(tmp_path):
    never_fused = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    never_fused.save_pretrained(tmp_path / "plain")
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    decode_logits(model, IDS)
    assert fused_count(model) == len(model.config.delta_layers) == 2
    assert set(model.state_dict()) == set(never_fused.state_dict())
    model.save_pretrained(tmp_path / "fused")
    saved = load_file(tmp_path / "fused" / "model.safetensors")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert set(saved) == set(plain) and all(torch.equal(saved[name], plain[name]) for name in saved)

    again = DeltaForCausalLM.from_pretrained(tmp_path / "fused").eval()
    input_ids = [[5, 9, 17, 33, 2, 41, 8, 8, 60]]
    with torch.no_grad():
        logits = model(torch.tensor(input_ids)).logits
        assert torch.equal(again(torch.tensor(input_ids)).logits, logits)
    out = load_isolated(tmp_path / "fused", input_ids, tmp_path)  # transformers' remote-code path
    assert (out["logits"] - logits).abs().max() <= FLOAT32_ATOL  # there, the default: no fused copy
    assert torch.equal(out["generated"], model.generate(torch.tensor(input_ids)[:1, :6], max_new_tokens=8,
                                                        do_sample=False))


@pytest.mark.parametrize("config", ["scalar gate", "channel gate", "GQA-shared state", "hybrid"])
def test_short_blocks_take_the_fast_step_and_equal_the_chunked_kernel(config, monkeypatch, decode_steps):
    """A block of a few tokens on a cache (a speculative verification) takes the fast step (its delta rule solved as
    one block) at inference, equal to the chunked kernel's result; so does the reference path's short block
    (`block_delta_rule` inside `_delta_rule`); with autograd, and beyond `SHORT_BLOCK_TOKENS`, the chunked kernel
    runs."""
    import delta_attention.modeling.modeling_delta as modeling

    chunk_calls = []
    chunk = modeling.chunk_delta_rule

    def counted_chunk(query, *args, **kwargs):
        chunk_calls.append(query.shape[1])
        return chunk(query, *args, **kwargs)

    monkeypatch.setattr(modeling, "chunk_delta_rule", counted_chunk)
    model = tiny_delta_model(**CONFIGS[config])
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    delta_layers = len(model.config.delta_layers)

    def run(short_block_tokens, fast=True):
        monkeypatch.setattr(DeltaAttention, "SHORT_BLOCK_TOKENS", short_block_tokens)
        reference_path(model, fast)
        chunk_calls.clear()
        decode_steps.clear()
        with torch.no_grad():
            cache = model(ids[:, :30], use_cache=True).cache  # 30 tokens: the chunked kernel
            logits = model(ids[:, 30:], cache=cache).logits  # a block of 10
        return logits, cache, list(chunk_calls), len(decode_steps)

    short, short_cache, short_calls, short_steps = run(16)
    closed_form, closed_form_cache, closed_form_calls, closed_form_steps = run(16, fast=False)
    chunked, chunked_cache, chunked_calls, chunked_steps = run(0)
    assert short_calls == closed_form_calls == [30] * delta_layers
    assert chunked_calls == [30] * delta_layers + [10] * delta_layers
    assert (short_steps, closed_form_steps, chunked_steps) == (delta_layers, 0, 0)
    for logits, cache in ((short, short_cache), (closed_form, closed_form_cache)):
        assert (logits - chunked).abs().max() <= FLOAT32_ATOL
        for got, want in zip(states(cache), states(chunked_cache), strict=True):
            assert (got - want).abs().max() <= FLOAT32_ATOL
    monkeypatch.setattr(DeltaAttention, "SHORT_BLOCK_TOKENS", 16)
    chunk_calls.clear()
    model(ids[:, :10]).logits.sum().backward()  # training: the chunked kernel, whatever the length
    assert chunk_calls == [10] * delta_layers


@pytest.mark.parametrize("config", ["scalar gate", "channel gate", "no gate, no conv", "GQA-shared state", "hybrid"])
@torch.no_grad()
def test_recorded_steps_take_the_fast_step_and_roll_back_exactly(config, decode_steps):
    """While the cache records for a rollback (assisted decoding), a decode step and a verification block take the
    fast step too, recording what `crop` replays: after crop(-n) the cache equals the reference path's run over the
    tokens kept, and continues like it."""
    model = tiny_delta_model(**CONFIGS[config])
    ids = torch.randint(3, 97, (2, 22), generator=torch.Generator().manual_seed(6))
    prompt, step, block, after = ids[:, :10], ids[:, 10:11], ids[:, 11:18], ids[:, 18:]
    delta_layers = len(model.config.delta_layers)
    for kept in (0, 3, 7):
        reference_path(model, True)
        cache = model(prompt, use_cache=True).cache
        cache.activate_past_recording()
        decode_steps.clear()
        model(step, cache=cache)
        model(block, cache=cache)
        assert len(decode_steps) == 2 * delta_layers  # the step and the block, in every delta layer
        cache.crop(-(block.shape[1] - kept))
        reference_path(model)
        reference = model(torch.cat([prompt, step, block[:, :kept]], 1), use_cache=True).cache
        assert cache.get_seq_length() == reference.get_seq_length() == 11 + kept
        for got, want in zip(states(cache), states(reference), strict=True):
            assert got.shape == want.shape and (got - want).abs().max() <= FLOAT32_ATOL
        got, want = model(after, cache=cache).logits, model(after, cache=reference).logits
        assert (got - want).abs().max() <= FLOAT32_ATOL


@torch.no_grad()
def test_a_block_longer_than_the_rollback_bound_takes_the_reference_path(decode_steps):
    """A recording cache keeps at most `max_rollback` tokens to replay; a longer block goes through the reference
    path, which records only its last `max_rollback` tokens, and a crop within them stays exact."""
    from delta_attention.modeling.delta_cache import DeltaCache

    model = tiny_delta_model()
    ids = torch.randint(3, 97, (1, 18), generator=torch.Generator().manual_seed(7))
    cache = DeltaCache(config=model.config, max_rollback=4)
    model(ids[:, :8], cache=cache)
    cache.activate_past_recording()
    decode_steps.clear()
    model(ids[:, 8:14], cache=cache)  # 6 tokens > max_rollback = 4
    assert not decode_steps
    cache.crop(-4)
    reference_path(model)
    reference = model(ids[:, :10], use_cache=True).cache
    for got, want in zip(states(cache), states(reference), strict=True):
        assert (got - want).abs().max() <= FLOAT32_ATOL


@torch.no_grad()
def test_a_conv_window_short_of_the_kernel_takes_the_reference_path(decode_steps):
    """A cache that records from its first token keeps a 2-token prompt's conv inputs unpadded: a block after it
    lacks the K - 1 inputs the fast step's window needs and takes the reference path (zeros before the first input),
    after which the window is full and steps are fast again; all equal to a plain run."""
    from delta_attention.modeling.delta_cache import DeltaCache

    model = tiny_delta_model()  # conv kernel 4
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(8))
    cache = DeltaCache(config=model.config)
    cache.activate_past_recording()
    logits = [model(ids[:, :2], cache=cache).logits]
    delta_layer = next(layer for layer in cache.layers if hasattr(layer, "recorded"))
    assert delta_layer.conv_states[0].shape[-1] == 2
    logits.append(model(ids[:, 2:5], cache=cache).logits)
    assert not decode_steps
    logits.append(model(ids[:, 5:], cache=cache).logits)
    assert len(decode_steps) == len(model.config.delta_layers)
    reference_path(model)
    want = model(ids, use_cache=False).logits
    assert (torch.cat(logits, 1) - want).abs().max() <= FLOAT32_ATOL
