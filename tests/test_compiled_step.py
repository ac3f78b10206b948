"""The compiled decode step (`modeling/compiled_step.py`, `DeltaForCausalLM.enable_compiled_decode`) against the eager
path: `layer_token_step` (the whole delta decoder layer for one token) computes what the layer's `forward` does, its
compiled form computes what the function does, every step it cannot cover runs eagerly, and without a working
compiler the model logs one warning and decodes eagerly.

Tolerances: float32 logits, states and conv windows within 1e-5 (absolute) of the eager path (the same maths, sums in
another order); a bf16 model's logits within 0.05 of the float32 model's (logits of about unit size; bf16 keeps 8
bits of mantissa, about 4e-3 relative per op), as for the eager fast path (tests/test_fast_decode.py)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model

from conftest import HYBRID_LAYERS, prefill_then_decode, tiny_delta_model
from delta_attention import DeltaCache
from delta_attention.modeling import compiled_step, modeling_delta
from delta_attention.modeling.modeling_delta import DeltaAttention, DeltaDecoderLayer

FLOAT32_ATOL = 1e-5
BF16_ATOL = 0.05
IDS = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
PREFILL = 5

CONFIGS = {
    "scalar gate": {},
    "channel gate": dict(linear_gate="channel"),
    "no gate, no conv": dict(linear_gate="none", linear_conv_kernel_size=0),
    "GQA-shared state, qk norm": dict(linear_state_sharing="kv_head", use_qk_norm=True),
    "no output gate, conv without activation": dict(linear_output_gate=False, linear_conv_activation=None),
    "decay floor, negative eigenvalues, sigmoid gate": dict(linear_log_decay_floor=-2.0, linear_allow_neg_eigval=True,
                                                            linear_output_gate_activation="sigmoid"),
    "biases, gelu MLP": dict(attention_bias=True, mlp_bias=True, hidden_act="gelu"),
    "hybrid": dict(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6),
}


@pytest.fixture
def eager_steps(monkeypatch):
    """`compiled_layer_token_step` replaced by the uncompiled function, counting the layers it runs (no compile)."""
    calls = []

    def uncompiled(hidden_states, conv_window, state, weights, spec):
        calls.append(spec)
        return compiled_step.layer_token_step(hidden_states, conv_window, state, weights, spec)

    monkeypatch.setattr(modeling_delta, "compiled_layer_token_step", uncompiled)
    return calls


def states(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in (getattr(layer, "recurrent_states", {0: None})[0],
                                                  getattr(layer, "conv_states", {0: None})[0]) if t is not None]


def compare(model, compiled_model, ids=IDS, atol=FLOAT32_ATOL):
    """Decode `ids` after a prefill with both models; logits, states and conv windows within `atol`."""
    _, want, want_cache = prefill_then_decode(model, ids, PREFILL)
    _, got, got_cache = prefill_then_decode(compiled_model, ids, PREFILL)
    assert (got.float() - want.float()).abs().max() <= atol
    for got_state, want_state in zip(states(got_cache), states(want_cache), strict=True):
        assert (got_state.float() - want_state.float()).abs().max() <= atol
    assert got_cache.get_seq_length() == want_cache.get_seq_length() == ids.shape[1]


def with_compiled_decode(model):
    compiled = copy.deepcopy(model)
    compiled.enable_compiled_decode()
    return compiled


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_layer_function_equals_the_eager_decode_step(config, eager_steps):
    model = tiny_delta_model(**CONFIGS[config])
    compare(model, with_compiled_decode(model))
    # every decode step of every delta layer ran the function
    assert len(eager_steps) == (IDS.shape[1] - PREFILL) * len(model.config.delta_layers)


def test_the_layer_function_equals_the_reference_path(eager_steps):
    model = tiny_delta_model(linear_gate="channel", linear_state_sharing="kv_head")
    compiled = with_compiled_decode(model)
    for module in model.modules():
        if isinstance(module, DeltaAttention):
            module.fast_inference = False  # the plain per-projection, per-op path the fast ones are tested against
    compare(model, compiled)
    assert eager_steps


def test_compiled_decode_is_off_by_default_and_can_be_turned_off(eager_steps):
    model = tiny_delta_model()
    prefill_then_decode(model, IDS, PREFILL)
    assert not eager_steps and DeltaDecoderLayer.compiled_decode is False
    model.enable_compiled_decode()
    prefill_then_decode(model, IDS, PREFILL)
    assert len(eager_steps) == 7 * 3
    model.disable_compiled_decode()
    eager_steps.clear()
    prefill_then_decode(model, IDS, PREFILL)
    assert not eager_steps
    assert "compiled_decode" not in model.config.to_dict()  # a runtime switch: nothing reaches a checkpoint


def test_steps_it_does_not_cover_stay_eager(eager_steps):
    model = tiny_delta_model(num_hidden_layers=4, layer_types=HYBRID_LAYERS, sliding_window=6)
    model.enable_compiled_decode()
    with torch.no_grad():
        model(IDS, use_cache=True)  # prefill: many tokens
        cache = model(IDS[:, :4], use_cache=True).cache
        model(IDS[:, 4:7], cache=cache)  # a block of three tokens
        model.train()
        model(IDS[:, 7:8], cache=cache)  # training mode
        model.eval()
    assert not eager_steps
    cache = DeltaCache(config=model.config)
    cache.activate_past_recording()  # speculative decoding records the step's inputs for a rollback
    with torch.no_grad():
        model(IDS[:, 8:9], cache=model(IDS[:, :8], cache=cache).cache)
    assert not eager_steps
    with torch.enable_grad():
        cache = model(IDS[:, :4], use_cache=True).cache
        assert model(IDS[:, 4:5], cache=cache).logits.requires_grad  # a decode step with autograd
    assert not eager_steps


def test_a_left_padded_batch_decodes_as_eagerly(eager_steps):
    # the padding mask reaches the delta layers in the prefill only: a decode step's new token is never padding
    model = tiny_delta_model(linear_gate="channel")
    compiled = with_compiled_decode(model)
    padded = torch.ones_like(IDS)
    padded[0, :3] = 0
    logits = []
    with torch.no_grad():
        for decoding in (model, compiled):
            out = decoding(IDS[:, :8], attention_mask=padded[:, :8], use_cache=True)
            logits.append(decoding(IDS[:, 8:9], attention_mask=padded[:, :9], cache=out.cache).logits)
    assert len(eager_steps) == 3 and (logits[1] - logits[0]).abs().max() <= FLOAT32_ATOL


def test_hooks_and_lora_keep_their_layers_eager(eager_steps):
    model = tiny_delta_model()
    model.enable_compiled_decode()
    seen = []
    handle = model.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, output: seen.append(1))
    prefill_then_decode(model, IDS, PREFILL)
    assert len(seen) == 9 and len(eager_steps) == 7 * 2  # the hooked layer eager at each of the 7 steps
    handle.remove()
    eager_steps.clear()
    handle = model.model.layers[0].mlp.act_fn.register_forward_pre_hook(lambda module, args: seen.append(0))
    prefill_then_decode(model, IDS, PREFILL)
    assert seen.count(0) == 9 and len(eager_steps) == 7 * 2  # a hook on an activation module runs too
    handle.remove()
    eager_steps.clear()
    global_handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        prefill_then_decode(model, IDS, PREFILL)
    finally:
        global_handle.remove()
    assert not eager_steps
    lora = get_peft_model(tiny_delta_model(), LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    lora.enable_compiled_decode()
    _, got, _ = prefill_then_decode(lora, IDS, PREFILL)
    assert not eager_steps
    merged = lora.merge_and_unload()  # plain layers again: compiled, and the same outputs
    merged.enable_compiled_decode()
    _, merged_logits, _ = prefill_then_decode(merged, IDS, PREFILL)
    assert eager_steps and (merged_logits - got).abs().max() <= FLOAT32_ATOL


@pytest.mark.parametrize("config", ["scalar gate", "GQA-shared state, qk norm"])
def test_the_compiled_step_equals_the_eager_decode_step(config, fresh_compile, caplog):
    model = tiny_delta_model(num_hidden_layers=4, **CONFIGS[config])
    torch._dynamo.utils.counters.clear()
    compare(model, with_compiled_decode(model))
    assert compiled_step._compiled is not None and not compiled_step._compile_failed  # it really ran compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for all four delta layers
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name == compiled_step.__name__]


def test_compiled_generate_gives_the_eager_tokens_in_float32_and_bf16(fresh_compile):
    model = tiny_delta_model(linear_gate="channel")
    compiled = with_compiled_decode(model)
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(IDS[:1, :6], **settings)
        assert torch.equal(compiled.generate(IDS[:1, :6], **settings), want)
        compiled.to(torch.bfloat16)
        _, float32_logits, _ = prefill_then_decode(model, IDS, PREFILL)
        _, bf16_logits, cache = prefill_then_decode(compiled, IDS, PREFILL)
    assert bf16_logits.dtype == torch.bfloat16 and all(layer.recurrent_states[0].dtype == torch.float32
                                                       for layer in cache.layers)
    assert (bf16_logits.float() - float32_logits).abs().max() <= BF16_ATOL


FALLBACK_SCRIPT = """
import copy, logging, torch
import torch._inductor.config as inductor_config
from conftest import prefill_then_decode, tiny_delta_model
import delta_attention.modeling.compiled_step as compiled_step
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
inductor_config.cpp.cxx = ("/nonexistent/c++",)  # a machine without a C++ compiler
inductor_config.fx_graph_cache = False  # nothing compiled earlier may be reused
model = tiny_delta_model()
compiled = copy.deepcopy(model)
compiled.enable_compiled_decode()
ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
_, want, want_cache = prefill_then_decode(model, ids, 4)
_, got, got_cache = prefill_then_decode(compiled, ids, 4)
assert torch.equal(got, want) and compiled_step._compile_failed
layers = zip(got_cache.layers, want_cache.layers)
assert all(torch.equal(a.recurrent_states[0], b.recurrent_states[0]) for a, b in layers)
print("EQUAL")
"""


def test_without_a_working_compiler_it_logs_one_line_and_decodes_eagerly(request):
    # a fresh process, as on a machine without a compiler (inductor's own codegen errors differ once it has compiled)
    tests = str(request.path.parent)
    done = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": tests})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["EQUAL"]
    logged = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR", "CRITICAL"))]
    assert len(logged) == 1, logged
    assert logged[0].startswith(f"WARNING {compiled_step.__name__}: delta decode step: torch.compile failed (")
    assert "No working C++ compiler" in logged[0] and "using the eager path" in logged[0]


def test_the_decode_benchmark_times_compiled_copies_beside_the_models(eager_steps):
    from delta_attention.scripts.bench_models import run_decode_benchmark, run_prefill_benchmark, with_compiled_decode

    models = {"delta": tiny_delta_model(num_hidden_layers=2),
              "hybrid": tiny_delta_model(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])}
    both = with_compiled_decode(models)
    assert list(both) == ["delta", "delta+compiled", "hybrid", "hybrid+compiled"]
    assert not models["delta"].model.layers[0].compiled_decode  # the copies compile, not the models
    assert all(layer.compiled_decode for layer in both["hybrid+compiled"].model.layers)
    decode = run_decode_benchmark(both, [16], steps=2, log=lambda *_: None)
    labels = [row["model"] for row in decode["rows"]]
    assert labels == ["one delta layer", "delta", "delta+compiled", "hybrid", "hybrid+StaticCache", "hybrid+compiled",
                      "hybrid+compiled+StaticCache"]
    # 3 steps (one untimed) of the two compiled copies: the all-delta's two layers, the hybrid's one per cache
    assert len(eager_steps) == 3 * 2 + 2 * 3 * 1
    prefill = run_prefill_benchmark(both, [8], log=lambda *_: None)
    assert [row["model"] for row in prefill["rows"]] == ["delta", "hybrid"]
