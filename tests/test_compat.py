"""What transformers, PEFT and accelerate users do to a model: the deprecated `past_key_values=` name, padding
inside a sequence, packed documents (padding-free training) and `torch.compile` with a static cache."""

import pytest
import torch
from transformers import StaticCache

from conftest import HYBRID_LAYERS, tiny_delta_model

LAYOUTS = {"all_delta": ["linear_attention"] * 3, "hybrid": HYBRID_LAYERS}


def build(layout, seed=3, **overrides):
    """A tiny model whose short convs are random (not the identity they start as), so they mix tokens."""
    model = tiny_delta_model(seed=seed, num_hidden_layers=len(LAYOUTS[layout]), layer_types=LAYOUTS[layout],
                             sliding_window=6, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.layer_type == "linear_attention":
                layer.self_attn.conv1d.weight.normal_(0, 0.5)
    return model


def tokens(*shape, seed=0):
    return torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(seed))


def prefilled(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=True).cache


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_past_key_values_is_accepted_as_the_old_name_of_cache(layout):
    # as transformers' own models (`deprecate_kwarg`), on the causal LM and on the base model
    model = build(layout)
    ids = tokens(2, 12)
    with torch.no_grad():
        new_name = model(ids[:, 8:], cache=prefilled(model, ids[:, :8]))
        old = prefilled(model, ids[:, :8])
        old_name = model(ids[:, 8:], past_key_values=old)
        base_new = model.model(ids[:, 8:], cache=prefilled(model, ids[:, :8])).last_hidden_state
        base_old = model.model(ids[:, 8:], past_key_values=prefilled(model, ids[:, :8])).last_hidden_state
    assert old_name.cache is old and old.get_seq_length() == 12
    assert torch.equal(old_name.logits, new_name.logits)
    assert torch.equal(base_old, base_new)


@pytest.mark.parametrize("gate", ["scalar", "channel"])
def test_a_masked_token_inside_a_row_is_a_no_op(gate):
    # a masked position takes no conv tap, writes nothing and decays nothing: the same as removing it
    model = build("all_delta", linear_gate=gate)
    ids = tokens(2, 14, seed=1)
    mask = torch.ones_like(ids)
    mask[:, 6] = 0  # in the middle of both rows
    mask[1, 0] = mask[1, 10] = 0  # and more in the second
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        # through the cache: a masked prefill, a continuation with a masked token, then one token at a time
        # (a single-token step is never padding, as in transformers)
        out = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        stepped = [out.logits]
        out = model(ids[:, 8:11], attention_mask=mask[:, :11], cache=out.cache)
        stepped.append(out.logits)
        for t in range(11, 14):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=out.cache)
            stepped.append(out.logits)
        stepped = torch.cat(stepped, 1)
        for row in range(2):
            kept = mask[row].bool()
            alone = model(ids[row : row + 1, kept]).logits[0]
            assert (full[row, kept] - alone).abs().max() <= 1e-5, row
            assert (stepped[row, kept] - alone).abs().max() <= 1e-5, row


def packed_documents(lengths, seed):
    documents = [tokens(1, n, seed=seed + n) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]  # as `DataCollatorWithFlattening` gives
    return documents, torch.cat(documents, 1), position_ids


@pytest.mark.parametrize("layout,gate", [("all_delta", "none"), ("all_delta", "scalar"), ("all_delta", "channel"),
                                         ("hybrid", "scalar")])
def test_packed_documents_equal_each_document_alone(layout, gate):
    model = build(layout, linear_gate=gate)
    rows = [packed_documents([5, 19, 7], seed=0), packed_documents([20, 11], seed=40)]  # 31 tokens per row
    input_ids = torch.cat([row[1] for row in rows])
    position_ids = torch.cat([row[2] for row in rows])
    out = model(input_ids, position_ids=position_ids, labels=input_ids)
    assert out.cache is None  # training input: no past to continue
    with torch.no_grad():
        for row, (documents, _, _) in enumerate(rows):
            alone = torch.cat([model(document).logits for document in documents], 1)[0]
            assert (out.logits[row] - alone).abs().max() <= 1e-5, row
    out.loss.backward()
    delta = model.model.layers[0].self_attn
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (delta.conv1d.weight, delta.b_proj.weight))


def test_packed_rows_run_the_projections_over_the_rows_not_one_padded_row_per_document():
    # only the conv and the delta rule need one document per row; the projections see the packed tokens as they
    # are (B x T), not documents x longest, which for many short documents would be several times as many
    model = build("all_delta")
    attention = model.model.layers[0].self_attn
    seen = {}
    hooks = [getattr(attention, name).register_forward_hook(
        lambda module, args, output, name=name: seen.__setitem__(name, tuple(args[0].shape[:-1])))
        for name in ("q_proj", "b_proj", "o_proj")]
    _, input_ids, position_ids = packed_documents([3, 4, 2, 3, 4, 15], seed=0)  # 6 documents, the longest 15
    with torch.no_grad():
        model(input_ids, position_ids=position_ids)
    for hook in hooks:
        hook.remove()
    assert seen == {"q_proj": (1, 31), "b_proj": (1, 31), "o_proj": (1, 31)}


def test_packed_position_ids_with_a_cache_are_refused():
    model = build("all_delta")
    _, input_ids, position_ids = packed_documents([4, 6], seed=0)
    with pytest.raises(ValueError, match="packed documents"), torch.no_grad():
        model(input_ids, position_ids=position_ids, cache=prefilled(model, tokens(1, 3)))


@pytest.mark.slow  # compiling takes about two minutes on a 2-core CPU
def test_compiled_decode_step_with_a_static_cache_matches_eager(monkeypatch):
    # `generate(compile_config=...)` compiles only on accelerators (transformers' `_valid_auto_compile_criteria`),
    # so compile the decode step directly, as a CPU user would
    from delta_attention.modeling import delta_rule

    # as in a fresh process: the kernel choice not logged yet (the log call once broke the full graph)
    monkeypatch.setattr(delta_rule, "_LOGGED", set())
    model = build("hybrid")
    prompt = tokens(2, 9, seed=2)

    def greedy(forward, steps=4):
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            logits = model(prompt, cache=cache).logits
            chosen = [logits[:, -1:].argmax(-1)]
            for position in range(9, 9 + steps):
                position_ids = torch.full((2, 1), position)
                logits = forward(input_ids=chosen[-1], position_ids=position_ids, cache=cache).logits
                chosen.append(logits[:, -1:].argmax(-1))
        return torch.cat(chosen, 1), logits

    eager_tokens, eager_logits = greedy(model.forward)
    compiled_tokens, compiled_logits = greedy(torch.compile(model.forward, fullgraph=True, dynamic=False))
    assert torch.equal(compiled_tokens, eager_tokens)
    assert (compiled_logits - eager_logits).abs().max() <= 1e-5
