"""`block_delta_rule`, the closed form of one short block (the fast path of speculative verification), against the
per-token reference: outputs and final state for every gate, with and without a state, steep decays (exact, no
overflow), bf16 inputs, gradients, and an empty block. GQA-shared states: tests/test_gqa_kernels.py."""

import pytest
import torch

from conftest import delta_rule_inputs
from delta_attention.modeling.delta_block import block_delta_rule
from delta_attention.modeling.delta_rule import delta_rule_reference

GATES = ["none", "scalar", "channel"]
FLOAT32_ATOL = 1e-5
BF16_ATOL = 0.05  # bf16 inputs: both sides read the same rounded inputs; only float32 rounding differs


def state_like(seed=3):
    return torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(seed))


def assert_close(got, want, atol=FLOAT32_ATOL):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all() and (got.float() - want.float()).abs().max() <= atol


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("seq_len", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("with_state", [False, True])
def test_block_equals_the_per_token_reference(gate, seq_len, with_state):
    q, k, v, beta, g = delta_rule_inputs(gate, seq_len=seq_len, seed=seq_len)
    state = state_like() if with_state else None
    o, final = block_delta_rule(q, k, v, beta, g, initial_state=state)
    o_want, final_want = delta_rule_reference(q, k, v, beta, g, initial_state=state)
    assert_close(o, o_want)
    assert_close(final, final_want)
    if state is not None:
        assert final.data_ptr() != state.data_ptr()  # a new state: the caller decides where it goes


@pytest.mark.parametrize("gate,decay", [("scalar", 40.0), ("channel", 60.0)])
def test_steep_decays_stay_exact(gate, decay):
    """Ratios of cumulative decays are taken as differences of log-decays: a decay of e^-60 per token over 16 tokens
    (e^-960 in all) neither underflows into 0/0 nor overflows."""
    q, k, v, beta, g = delta_rule_inputs(gate, seq_len=16, decay=decay, seed=1)
    o, final = block_delta_rule(q, k, v, beta, g, initial_state=state_like())
    o_want, final_want = delta_rule_reference(q, k, v, beta, g, initial_state=state_like())
    assert_close(o, o_want)
    assert_close(final, final_want)


@pytest.mark.parametrize("gate", GATES)
def test_bf16_inputs_give_bf16_outputs_and_a_float32_state(gate):
    q, k, v, beta, g = delta_rule_inputs(gate, seq_len=11, seed=2, dtype=torch.bfloat16)
    o, final = block_delta_rule(q, k, v, beta, g, initial_state=state_like())
    o_want, final_want = delta_rule_reference(q, k, v, beta, g, initial_state=state_like())
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert_close(o, o_want, BF16_ATOL)
    assert_close(final, final_want, BF16_ATOL)


@pytest.mark.parametrize("gate", GATES)
def test_gradients_equal_the_reference(gate):
    inputs = [x for x in delta_rule_inputs(gate, seq_len=9, seed=4) if x is not None] + [state_like()]
    weights = torch.randn(2, 9, 3, 8, generator=torch.Generator().manual_seed(5))

    def gradients(kernel):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        q, k, v, beta = leaves[:4]
        g = leaves[4] if gate != "none" else None
        o, final = kernel(q, k, v, beta, g, initial_state=leaves[-1])
        ((o * weights).sum() + final.square().sum()).backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(gradients(block_delta_rule), gradients(delta_rule_reference), strict=True):
        assert_close(got, want, 1e-4)


def test_an_empty_block_keeps_the_state():
    q, k, v, beta, g = delta_rule_inputs("scalar", seq_len=0)
    o, final = block_delta_rule(q, k, v, beta, g, initial_state=state_like())
    assert o.shape == (2, 0, 3, 8) and torch.equal(final, state_like())
    o, final = block_delta_rule(q, k, v, beta, g)
    assert torch.equal(final, torch.zeros(2, 3, 16, 8))


@pytest.mark.parametrize("limit", [0.0, float("inf")])
def test_per_channel_decays_by_ratios_and_by_factors_agree(monkeypatch, limit):
    """Per-channel decays take factored scores (two matmuls) while the block's cumulative decay stays within
    e^+-60, the ratios themselves beyond: both forms, forced here, equal the reference."""
    from delta_attention.modeling import delta_block

    monkeypatch.setattr(delta_block, "FACTORED_LOG_DECAY", limit)
    q, k, v, beta, g = delta_rule_inputs("channel", seq_len=12, decay=3.0, seed=6)
    o, final = block_delta_rule(q, k, v, beta, g, initial_state=state_like())
    o_want, final_want = delta_rule_reference(q, k, v, beta, g, initial_state=state_like())
    assert_close(o, o_want)
    assert_close(final, final_want)


def test_gradients_stay_finite_near_the_factored_limit():
    """A per-channel decay whose block total nears e^-60 still takes the factored scores; their gradients equal the
    reference's (1 / c_s is formed as exp(-G), whose derivative stays within e^60, not as a division, whose
    derivative 1 / c_s^2 overflows float32)."""
    from delta_attention.modeling.delta_block import FACTORED_LOG_DECAY

    q, k, v, beta, _ = delta_rule_inputs("channel", seq_len=12, seed=7)
    g = torch.full((*k.shape[:3], k.shape[-1]), -0.99 * FACTORED_LOG_DECAY / 12)
    weights = torch.randn(2, 12, 3, 8, generator=torch.Generator().manual_seed(8))

    def gradients(kernel):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g, state_like())]
        o, final = kernel(*leaves[:5], initial_state=leaves[5])
        ((o * weights).sum() + final.square().sum()).backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(gradients(block_delta_rule), gradients(delta_rule_reference), strict=True):
        assert_close(got, want, 1e-4)
