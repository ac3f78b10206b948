"""GQA-shared delta state: q with G query heads per KV head, one state per KV head (k, v, beta, g and the state
per KV head; query head h reads state h // G). Every kernel must be exactly the per-head computation with k, v,
beta, g and the initial state repeated over each group: the same outputs, and every repeated head's state equal
to the shared one."""

import pytest
import torch

from delta_attention.modeling import delta_chunk
from delta_attention.modeling.delta_block import block_delta_rule
from delta_attention.modeling.delta_reference import chunk_delta_rule_elementwise
from delta_attention.modeling.delta_rule import chunk_delta_rule, delta_rule_reference, recurrent_delta_rule

from conftest import delta_rule_inputs
from test_fast_kernels import bf16_inputs, fla_stand_in

GATES = ["none", "scalar", "channel"]
GROUPS, KV_HEADS = 3, 2  # 6 query heads


def gqa_inputs(gate, seq_len, decay=1.0, groups=GROUPS, seed=0):
    """q [2, T, G * Hkv, 16]; k, v, beta, g per KV head (see `conftest.delta_rule_inputs`)."""
    _, k, v, beta, g = delta_rule_inputs(gate, seq_len=seq_len, heads=KV_HEADS, decay=decay, seed=seed)
    q = delta_rule_inputs("none", seq_len=seq_len, heads=KV_HEADS * groups, seed=seed + 1)[0]
    return q, k, v, beta, g


def per_head(k, v, beta, g, state, groups=GROUPS):
    """The per-KV-head tensors repeated over each group of query heads: head h is KV head h // G."""
    def repeat(x, dim=2):
        return None if x is None else x.repeat_interleave(groups, dim=dim)

    return repeat(k), repeat(v), repeat(beta), repeat(g), repeat(state, dim=1)


def assert_matches_per_head(q, k, v, beta, g, state, o, final, tolerance=1e-5):
    """`(o, final)` of a GQA kernel against the per-head reference on repeated inputs."""
    k_h, v_h, beta_h, g_h, state_h = per_head(k, v, beta, g, state)
    o_want, s_want = delta_rule_reference(q, k_h, v_h, beta_h, g_h, initial_state=state_h)
    assert o.shape == o_want.shape and final.shape == (2, KV_HEADS, 16, 8)
    assert (o - o_want).abs().max() <= tolerance
    for head in range(q.shape[2]):  # every repeated head carries the shared state of its KV head
        assert (s_want[:, head] - final[:, head // GROUPS]).abs().max() <= tolerance, head


def run_kernel(kernel, q, k, v, beta, g, state):
    if kernel == "recurrent":
        return recurrent_delta_rule(q, k, v, beta, g, initial_state=state)
    if kernel == "inplace":
        buffer = torch.zeros(2, KV_HEADS, 16, 8) if state is None else state.clone()
        pointer = buffer.data_ptr()
        o, final = recurrent_delta_rule(q, k, v, beta, g, initial_state=buffer, inplace=True)
        assert final is buffer and buffer.data_ptr() == pointer
        return o, final
    if kernel == "reference":
        return delta_rule_reference(q, k, v, beta, g, initial_state=state)
    if kernel == "block":
        return block_delta_rule(q, k, v, beta, g, initial_state=state)
    form, chunk = kernel.split("-")
    implementation = "fast" if form == "fast" else "elementwise"
    return chunk_delta_rule(q, k, v, beta, g, initial_state=state, chunk_size=int(chunk),
                            implementation=implementation)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("seq_len", [1, 63, 65, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("kernel", ["reference", "recurrent", "inplace", "block", "fast-16", "fast-64",
                                    "elementwise-16"])
def test_gqa_kernels_equal_the_per_head_computation(gate, seq_len, with_state, kernel):
    q, k, v, beta, g = gqa_inputs(gate, seq_len)
    state = torch.randn(2, KV_HEADS, 16, 8) if with_state else None
    o, final = run_kernel(kernel, q, k, v, beta, g, state)
    assert_matches_per_head(q, k, v, beta, g, state, o, final)


# (gate, decay strength, chunk, score form of the fast kernel): as in test_fast_kernels.CASES
SCORE_CASES = [("scalar", 12.0, 16, "gamma"), ("channel", 3.5, 64, "blocks"), ("channel", 1.0, 16, "factored")]


@pytest.mark.parametrize("gate,decay,chunk,mode", SCORE_CASES)
def test_gqa_fast_kernel_in_every_score_form(gate, decay, chunk, mode):
    q, k, v, beta, g = gqa_inputs(gate, 130, decay=decay)
    qk, *_, log_decay = delta_chunk._prepare(q, k, v, beta, g, chunk)
    assert qk.shape[3] == GROUPS + 1  # the group's queries stacked next to their key
    assert delta_chunk._Scores(qk, qk, log_decay, None, channel=gate == "channel").mode == mode
    state = torch.randn(2, KV_HEADS, 16, 8)
    o, final = delta_chunk.fast_chunk_delta_rule(q, k, v, beta, g, initial_state=state, chunk_size=chunk)
    assert_matches_per_head(q, k, v, beta, g, state, o, final)


def gradients(kernel, inputs, weights, per_head_inputs: bool):
    """Gradients of a fixed loss on (o, the shared final state) with respect to q, k, v, beta, state (and g)."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    q, k, v, beta, state = leaves[:5]
    g = leaves[5] if len(leaves) == 6 else None
    if per_head_inputs:  # autograd sums each repeated head's gradient back onto its KV head
        k, v, beta, g, state = per_head(k, v, beta, g, state)
    out, final = kernel(q, k, v, beta, g, initial_state=state)
    if per_head_inputs:
        final = final[:, ::GROUPS]  # the first head of each group: the shared state
    ((out * weights).sum() + final.square().sum()).backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("form", ["fast", "elementwise"])
@pytest.mark.parametrize("decay,chunk", [(1.0, 16), (1.0, 64), (4.0, 64)])
def test_gqa_chunked_gradients_match_the_reference(gate, form, decay, chunk):
    q, k, v, beta, g = gqa_inputs(gate, 70, decay=decay)
    inputs = [q, k, v, beta, torch.randn(2, KV_HEADS, 16, 8)] + ([g] if g is not None else [])
    weights = torch.randn(2, 70, KV_HEADS * GROUPS, 8)
    kernel = delta_chunk.fast_chunk_delta_rule if form == "fast" else chunk_delta_rule_elementwise
    got = gradients(lambda *a, **kw: kernel(*a, **kw, chunk_size=chunk), inputs, weights, per_head_inputs=False)
    want = gradients(delta_rule_reference, inputs, weights, per_head_inputs=True)
    for name, a, b in zip(["q", "k", "v", "beta", "state", "g"], got, want):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item()), name


def test_gqa_is_read_off_the_shapes():
    q, k, v, beta, g = gqa_inputs("scalar", 5)
    assert chunk_delta_rule(q, k, v, beta, g)[0].shape == (2, 5, KV_HEADS * GROUPS, 8)
    with pytest.raises(ValueError, match=r"Hkv dividing q's heads"):
        chunk_delta_rule(q[:, :, :5], k, v, beta, g)  # 5 query heads for 2 KV heads
    with pytest.raises(ValueError, match=r"beta must have k's \[B, T, Hkv\]"):
        recurrent_delta_rule(q, k, v, beta.repeat_interleave(GROUPS, dim=2), g)
    with pytest.raises(ValueError, match=r"initial_state has shape \(2, 6, 16, 8\), expected \(2, 2, 16, 8\)"):
        chunk_delta_rule(q, k, v, beta, g, initial_state=torch.zeros(2, 6, 16, 8))


@pytest.mark.parametrize("gate", GATES)
def test_gqa_through_fla_repeats_the_group_and_keeps_one_state(monkeypatch, gate):
    """fla's kernels take one head count: the dispatch repeats the key side over each group and hands back the
    shared [B, Hkv, K, V] state (in place for the decode step)."""
    calls = fla_stand_in(monkeypatch)
    _, k, v, beta, g = bf16_inputs(gate, seq_len=20, heads=KV_HEADS)
    q = gqa_inputs(gate, 20)[0].bfloat16()
    state = torch.randn(2, KV_HEADS, 16, 8)
    o, final = chunk_delta_rule(q, k, v, beta, g, initial_state=state)
    buffer = final.clone()
    step = [None if x is None else x[:, :1] for x in (q, k, v, beta, g)]
    o1, final1 = recurrent_delta_rule(*step, initial_state=buffer, inplace=True)
    monkeypatch.undo()
    assert [c["heads"] for c in calls] == [(KV_HEADS * GROUPS,) * 2] * 2
    assert final1 is buffer
    assert_matches_per_head(q, k, v, beta, g, state, o.float(), final, tolerance=1e-5)
    assert_matches_per_head(*step, final, o1.float(), buffer, tolerance=1e-5)
