"""DeltaModel / DeltaForCausalLM: cached prefill + decode == one full forward, cache memory, checkpointing."""

import pytest
import torch
from transformers import DynamicCache

from conftest import HYBRID_LAYERS, prefill_then_decode, tiny_delta_model
from delta_attention.conversion.memory import cache_bytes

ALL_DELTA = ["linear_attention"] * 3
LAYOUTS = {"all_delta": ALL_DELTA, "hybrid": HYBRID_LAYERS}


def build(layout, gate="scalar", **overrides):
    return tiny_delta_model(
        num_hidden_layers=len(LAYOUTS[layout]), layer_types=LAYOUTS[layout], sliding_window=6, linear_gate=gate,
        **overrides,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gate", ["none", "scalar", "channel"])
def test_prefill_then_decode_matches_full_forward(layout, gate):
    model = build(layout, gate)
    input_ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    full, stepped, _ = prefill_then_decode(model, input_ids, 25)
    assert (stepped - full).abs().max() <= 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("conv", [4, 0])
def test_prefill_in_two_pieces_matches_one(layout, conv):
    # conv=0 exercises the pitfall where only `update_conv_state` sets `has_previous_state`
    model = build(layout, linear_conv_kernel_size=conv)
    input_ids = torch.randint(3, 97, (2, 50), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids).logits
        first = model(input_ids[:, :17], use_cache=True)
        second = model(input_ids[:, 17:], cache=first.cache)
        third = model(input_ids[:, :1], cache=second.cache)  # the cache keeps working after the pieces
    assert (torch.cat([first.logits, second.logits], 1) - full).abs().max() <= 1e-4
    reference = model(torch.cat([input_ids, input_ids[:, :1]], 1)).logits[:, -1:]
    assert (third.logits - reference).abs().max() <= 1e-4


def test_eager_and_sdpa_attention_agree():
    model = build("hybrid")
    input_ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        sdpa = model(input_ids).logits
        model.set_attn_implementation("eager")
        eager = model(input_ids).logits
    assert (sdpa - eager).abs().max() <= 1e-4


def test_all_delta_cache_memory_is_constant_in_context_length():
    model = build("all_delta")
    with torch.no_grad():
        short = model(torch.randint(3, 97, (1, 16)), use_cache=True).cache
        long = model(torch.randint(3, 97, (1, 4096)), use_cache=True).cache
        sizes = [cache_bytes(short), cache_bytes(long)]
        for _ in range(3):
            long = model(torch.randint(3, 97, (1, 1)), cache=long).cache
        sizes.append(cache_bytes(long))
    assert sizes[0] > 0 and sizes[0] == sizes[1] == sizes[2]
    # per delta layer: an H x K x V float32 state and the conv's last K inputs of q, k, v
    per_layer = 4 * 16 * 16 * 4 + (2 * 64 + 64) * 4 * 4
    assert sizes[0] == 3 * per_layer


def test_hybrid_cache_grows_only_in_softmax_layers():
    model = build("hybrid")
    with torch.no_grad():
        short = cache_bytes(model(torch.randint(3, 97, (1, 16)), use_cache=True).cache)
        long = cache_bytes(model(torch.randint(3, 97, (1, 64)), use_cache=True).cache)
    # only the full-attention layer grows: 48 more tokens x (K + V) x 2 KV heads x 16 dims x 4 bytes
    # (the sliding layer holds its last window - 1 = 5 tokens in both runs)
    assert long - short == 48 * 2 * 2 * 16 * 4


def test_a_cache_of_the_wrong_shape_is_refused_with_the_fix():
    model = build("hybrid")
    with pytest.raises(ValueError, match=r"DynamicCache\(config=model.config\)"):
        model(torch.tensor([[5, 6, 7]]), cache=DynamicCache())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradient_checkpointing_gives_the_same_gradients(layout):
    model = build(layout, gate="channel").train()
    input_ids = torch.randint(3, 97, (2, 33), generator=torch.Generator().manual_seed(4))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = gradients()
    assert model.model.gradient_checkpointing and plain.keys() == checkpointed.keys() and len(plain) > 10
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-5), name


def test_logits_to_keep_and_loss():
    model = build("hybrid")
    input_ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(input_ids, labels=input_ids)
        last = model(input_ids, logits_to_keep=1)
    assert last.logits.shape == (2, 1, 97)
    assert torch.allclose(last.logits, full.logits[:, -1:], atol=1e-5)
    expected = torch.nn.functional.cross_entropy(full.logits[:, :-1].reshape(-1, 97), input_ids[:, 1:].reshape(-1))
    assert torch.allclose(full.loss, expected, atol=1e-5)


def test_bf16_model_runs_with_float32_states_close_to_float32():
    model = build("hybrid")
    input_ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(input_ids).logits
        out = model.to(torch.bfloat16)(input_ids, use_cache=True)
    assert out.logits.dtype == torch.bfloat16
    assert out.cache.layers[0].recurrent_states[0].dtype == torch.float32
    # bf16 rounding through 4 layers: measured 1.0% relative (max 0.008 on logits up to 0.69); allowed 3%
    error = out.logits.float() - reference
    assert error.norm() <= 3e-2 * reference.norm() and error.abs().max() <= 3e-2


@pytest.mark.parametrize(
    "options",
    [
        dict(attention_bias=True, attention_out_bias=False, use_qk_norm=True),  # Qwen2 bias + Qwen3 q/k norm
        dict(linear_allow_neg_eigval=True, linear_output_gate=False, linear_conv_activation=None),
        dict(linear_num_heads=2, linear_key_head_dim=8, linear_value_head_dim=24, gate="channel",
             linear_gate_low_rank_dim=4),
    ],
    ids=["bias-qknorm", "negeig-nogate-noact", "custom-delta-heads"],
)
def test_model_options_keep_cached_and_full_forward_equal(options):
    model = build("hybrid", **options)
    input_ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(input_ids).logits
        out = model(input_ids[:, :21], use_cache=True)
        logits = [out.logits]
        for t in range(21, 30):
            out = model(input_ids[:, t : t + 1], cache=out.cache)
            logits.append(out.logits)
    assert (torch.cat(logits, 1) - full).abs().max() <= 1e-4
    if options.get("attention_bias"):
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.model.layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize("floor", [None, -3.5])
def test_log_decay_floor_keeps_steep_channel_gates_in_the_fast_kernel(monkeypatch, floor):
    """A trained channel gate can decay by e^-20 per token; the floor clamps the per-token log-decay, so the
    fast chunk kernel stays exact (no fallback to the elementwise form) and decode still equals the full
    forward. Without a floor the same gate falls back."""
    from delta_attention.modeling import delta_rule

    model = build("all_delta", gate="channel", linear_log_decay_floor=floor)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.dt_bias.fill_(20.0)  # softplus(20 + a) ~ 20: log-decay ~ -20 per token
    input_ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(5))
    attn = model.model.layers[0].self_attn
    log_decay = attn._log_decay(model.model.embed_tokens(input_ids))
    if floor is None:
        assert log_decay.min() < -15
    else:
        assert log_decay.min() == floor and (log_decay >= floor).all()

    fallbacks = []
    original = delta_rule.chunk_delta_rule_elementwise
    monkeypatch.setattr(delta_rule, "chunk_delta_rule_elementwise",
                        lambda *args, **kwargs: fallbacks.append(1) or original(*args, **kwargs))
    model.train()
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert bool(fallbacks) == (floor is None)
    model.eval()
    full, stepped, _ = prefill_then_decode(model, input_ids, 25)
    assert (stepped - full).abs().max() <= 1e-4
