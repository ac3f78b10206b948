"""Saved states (`save_cache` / `load_cache`): a cache written to safetensors and read back continues exactly as the
original run did; a file that another model computed is refused with one line naming the difference."""

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, StaticCache

from conftest import HYBRID_LAYERS
from delta_attention import DeltaCache, DeltaConfig, StateMismatchError, load_cache, save_cache, state_file_info
from delta_attention.conversion.memory import cache_figures
from delta_attention.modeling.cache_io import state_bytes, state_tensor_shapes
from delta_attention.scripts.bench_models import SMOLLM2_SHAPE
from test_generation import LAYOUTS, build, prompt

FIX = "load it with the model it was saved from"


def continue_run(model, cache, question, steps=3):
    """Logits of `question` and of `steps` greedy decode steps after it, continuing `cache` (which this advances)."""
    with torch.no_grad():
        logits = [model(question, cache=cache).logits]
        for _ in range(steps):
            logits.append(model(logits[-1][:, -1:].argmax(-1), cache=cache).logits)
    return logits


def saved_document(model, path, document):
    """Run `document` through `model` and save the state: (the cache, the file)."""
    with torch.no_grad():
        cache = model(document, use_cache=True).cache
    return cache, save_cache(cache, path, model)


@pytest.mark.parametrize("conv", [4, 0])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_continuing_a_loaded_state_equals_continuing_the_original_run(tmp_path, layout, conv):
    model = build(layout, linear_conv_kernel_size=conv)
    document, question = prompt(length=11, seed=1), prompt(length=5, seed=2)  # 11 tokens > the sliding window (6)
    cache, path = saved_document(model, tmp_path / "document.safetensors", document)
    assert state_file_info(path)["tokens"] == 11

    original = continue_run(model, cache, question)
    loaded = continue_run(model, load_cache(path, model), question)
    for step, (expected, got) in enumerate(zip(original, loaded)):
        assert torch.equal(got, expected), f"step {step}"

    # greedy generate from the whole prompt, the loaded state standing for the document
    whole = torch.cat([document, question], dim=1)
    with torch.no_grad():
        original_cache = model(document, use_cache=True).cache
    continued = model.generate(whole, cache=original_cache, max_new_tokens=8, do_sample=False)
    from_file = model.generate(whole, cache=load_cache(path, model), max_new_tokens=8, do_sample=False)
    straight = model.generate(whole, max_new_tokens=8, do_sample=False)
    assert torch.equal(from_file, continued)
    assert torch.equal(from_file, straight)


def file_tensors(path):
    with safe_open(path, "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def assert_same_state(first, second):
    assert state_file_info(first)["tokens"] == state_file_info(second)["tokens"]
    a, b = file_tensors(first), file_tensors(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_loaded_state_continued_saves_what_the_original_run_saves(tmp_path, layout):
    """The loaded cache is the cache the model would have filled: continued by the same tokens, it saves the same
    file (token counts included: a sliding layer counts every token seen, not only the keys it keeps)."""
    model = build(layout)
    document, more = prompt(length=11, seed=1), prompt(length=4, seed=6)
    cache, path = saved_document(model, tmp_path / "document.safetensors", document)
    loaded = load_cache(path, model)
    with torch.no_grad():
        model(more, cache=cache)
        model(more, cache=loaded)
    assert_same_state(save_cache(cache, tmp_path / "original.safetensors", model),
                      save_cache(loaded, tmp_path / "loaded.safetensors", model))
    assert state_file_info(tmp_path / "loaded.safetensors")["tokens"] == 15


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_cache_saved_while_a_draft_is_verified_holds_the_state_only(tmp_path, layout):
    """While the cache records for a rollback (assisted decoding), conv windows and sliding keys keep more inputs
    than the state needs; the file holds the state alone, as if nothing had been recorded."""
    model = build(layout)
    document, draft = prompt(length=11, seed=1), prompt(length=4, seed=6)
    with torch.no_grad():
        plain = model(document, use_cache=True).cache
        model(draft, cache=plain)
        recording = model(document, use_cache=True).cache
        recording.activate_past_recording()
        model(draft, cache=recording)
    if layout == "hybrid":
        assert recording.layers[2].keys.shape[-2] > 5  # the sliding layer kept more than its window for a crop
    assert_same_state(save_cache(plain, tmp_path / "plain.safetensors", model),
                      save_cache(recording, tmp_path / "recording.safetensors", model))


def test_state_file_holds_the_tensors_its_config_gives(tmp_path):
    model = build("hybrid")  # delta, full, sliding (window 6), delta; 4 delta heads of 16, 2 KV heads of 16
    with torch.no_grad():
        cache = model(prompt(batch=2, length=11), use_cache=True).cache
    path = save_cache(cache, tmp_path / "state.safetensors", model)
    info = state_file_info(path)
    assert (info["tokens"], info["batch_size"], info["dtype"], info["layer_types"]) == (11, 2, "float32", HYBRID_LAYERS)
    with safe_open(path, "pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        dtypes = {name: handle.get_tensor(name).dtype for name in handle.keys()}
    assert shapes == state_tensor_shapes(model.config, tokens=11, batch_size=2)
    assert shapes["layers.0.recurrent_state"] == (2, 4, 16, 16) and dtypes["layers.0.recurrent_state"] == torch.float32
    assert shapes["layers.0.conv_window"] == (2, 3 * 4 * 16, 4)
    assert shapes["layers.1.keys"] == (2, 2, 11, 16)  # full attention: every token
    assert shapes["layers.2.keys"] == (2, 2, 5, 16)  # sliding: the last window - 1 tokens
    assert 0 < path.stat().st_size - state_bytes(model.config, tokens=11, batch_size=2) < 8192  # tensors + header


def test_bfloat16_state_round_trip(tmp_path):
    model = build("hybrid").to(torch.bfloat16)
    document, question = prompt(length=11, seed=3), prompt(length=4, seed=4)
    cache, path = saved_document(model, tmp_path / "state.safetensors", document)
    assert state_file_info(path)["dtype"] == "bfloat16"
    with safe_open(path, "pt") as handle:
        assert handle.get_tensor("layers.0.recurrent_state").dtype == torch.float32  # the state stays float32
        assert handle.get_tensor("layers.0.conv_window").dtype == torch.bfloat16
        assert handle.get_tensor("layers.1.keys").dtype == torch.bfloat16
    original = continue_run(model, cache, question)
    loaded = continue_run(model, load_cache(path, model), question)
    assert all(torch.equal(a, b) for a, b in zip(original, loaded))


def test_all_delta_smollm2_sized_state_is_about_5_mb_at_any_context():
    """The figure of the README and the issue, from the config alone: 30 layers of 9 states [64, 64] (float32) and
    conv windows of 4 x 1728 channels; a Llama of the same shape holds 2.81 GiB of KV cache at 64k tokens."""
    all_delta = DeltaConfig(**SMOLLM2_SHAPE)
    size = state_bytes(all_delta, tokens=0)
    assert size == 30 * (9 * 64 * 64 * 4 + 4 * 1728 * 4) == 5_253_120  # 5.0 MiB
    assert state_bytes(all_delta, tokens=65_536) == size  # the same after any context
    assert size == cache_figures(all_delta, all_delta.layer_types).state_bytes  # the conversion report's figure
    softmax_only = DeltaConfig(**SMOLLM2_SHAPE, layer_types=["full_attention"] * 30)
    assert state_bytes(softmax_only, tokens=65_536) == 30 * 2 * 3 * 65_536 * 64 * 4  # 2.81 GiB
    assert state_bytes(softmax_only, tokens=65_536) / size > 500


def mismatching_target(case):
    """(a model or config that must refuse a state of `build("all_delta")`, the exact message after the file name)."""
    model = build("all_delta")
    if case == "layer types":
        return build("hybrid"), (
            "was saved from a model with 3 layers (3 linear_attention); this model has 4 layers (2 linear_attention, "
            "1 full_attention, 1 sliding_attention) (layer 1 is linear_attention there and full_attention here): "
            + FIX)
    if case == "head count":
        return build("all_delta", linear_num_heads=2), (
            "was saved from a model with linear_num_heads=4; this model has linear_num_heads=2: " + FIX)
    if case == "gate":
        return build("all_delta", linear_gate="channel"), (
            "was saved from a model with another configuration (linear_gate 'scalar' there, 'channel' here, "
            "linear_output_gate_activation 'silu' there, 'sigmoid' here): " + FIX)
    if case == "dtype":
        return model.to(torch.bfloat16), (
            "was saved from a float32 model; this model is bfloat16: load the model with dtype=torch.float32")
    if case == "weights":
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # e.g. after more training
        return model, "was saved from a model with the same configuration but other weights"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["layer types", "head count", "gate", "dtype", "weights"])
def test_a_state_of_another_model_is_refused_in_one_line(tmp_path, case):
    _, path = saved_document(build("all_delta"), tmp_path / "state.safetensors", prompt(length=9))
    target, message = mismatching_target(case)
    with pytest.raises(StateMismatchError) as error:
        load_cache(path, target)
    assert str(error.value).startswith(f"state file {path} {message}")
    assert "\n" not in str(error.value)


def test_a_config_loads_the_state_without_the_weights_check(tmp_path):
    model = build("all_delta")
    cache, path = saved_document(model, tmp_path / "state.safetensors", prompt(length=9))
    question = prompt(length=3, seed=5)
    assert torch.equal(continue_run(model, load_cache(path, model.config), question)[-1],
                       continue_run(model, cache, question)[-1])


def test_files_that_are_not_states_are_refused_in_one_line(tmp_path):
    model = build("all_delta")
    model.save_pretrained(tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    with pytest.raises(StateMismatchError, match="is not a delta-attention state file .* write one with save_cache$"):
        load_cache(weights, model)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(StateMismatchError, match=r"^state file .*garbage.safetensors is not a safetensors file \("):
        load_cache(garbage, model)
    with pytest.raises(FileNotFoundError, match="missing.safetensors: no such file$"):
        load_cache(tmp_path / "missing.safetensors", model)
    _, path = saved_document(model, tmp_path / "state.safetensors", prompt(length=9))
    with pytest.raises(StateMismatchError, match="this is a llama model: pass the delta model"):
        load_cache(path, LlamaConfig())


def test_save_refuses_caches_it_cannot_save(tmp_path):
    model = build("hybrid")
    with pytest.raises(ValueError, match="^the cache holds no tokens yet: run the model on a prompt"):
        save_cache(DeltaCache(config=model.config), tmp_path / "empty.safetensors", model)
    static = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(prompt(length=5), cache=static)
    with pytest.raises(ValueError, match="layer 1 is a StaticLayer: generate with the default cache"):
        save_cache(static, tmp_path / "static.safetensors", model)
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob(".*partial"))
