"""Induction heads and the auto layer plan that keeps them (`conversion/converter/induction.py`)."""

from __future__ import annotations

import json

import pytest
import torch

from delta_attention.conversion import ConversionSettings, convert_model
from delta_attention.conversion.converter import pipeline
from delta_attention.conversion.converter.induction import (
    copy_attention,
    induction_layers,
    induction_scores,
    repeated_sequences,
)
from delta_attention.conversion.converter.layer_plan import choose_auto, copy_slots
from delta_attention.conversion.publishing.cards import conversion_card
from test_convert import FAMILIES, FAST, tiny_source


def test_repeated_sequences_repeat_tokens_drawn_from_the_pool():
    pool = torch.tensor([[5, 7, 9], [11, 13, 15]])
    sequences = repeated_sequences(pool, length=16, count=3, seed=4)
    assert sequences.shape == (3, 32)
    assert torch.equal(sequences[:, :16], sequences[:, 16:])
    assert set(sequences.flatten().tolist()) <= {5, 7, 9, 11, 13, 15}
    assert torch.equal(sequences, repeated_sequences(pool, length=16, count=3, seed=4))
    assert not torch.equal(sequences, repeated_sequences(pool, length=16, count=3, seed=5))
    with pytest.raises(ValueError, match="length >= 2"):
        repeated_sequences(pool, length=1, count=3)


def test_copy_attention_reads_the_key_after_the_first_occurrence():
    length = 5
    weights = torch.zeros(1, 3, 2 * length, 2 * length)
    for query in range(2 * length):
        weights[0, 0, query, max(query - length + 1, 0)] = 1.0  # head 0: an exact induction head
        weights[0, 1, query, 0] = 1.0  # head 1: everything on the first token (a sink)
        weights[0, 2, query, query] = 0.5  # head 2: half on itself, half on the copy target
        weights[0, 2, query, max(query - length + 1, 0)] += 0.5
    # query 5 (the repeat's first token) has its copy target at key 1, query 9 at key 5
    assert torch.allclose(copy_attention(weights, length), torch.tensor([1.0, 0.0, 0.5]))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_induction_scores_match_the_models_own_attention_weights(family):
    source = tiny_source(family)
    sequences = repeated_sequences(torch.arange(3, 97), length=20, count=2, seed=0)
    scores = induction_scores(source, sequences)
    assert source.config._attn_implementation != "eager"  # restored afterwards
    source.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = source(input_ids=sequences, output_attentions=True).attentions
    expected = torch.stack([copy_attention(weights, 20) for weights in attentions])
    assert scores.shape == (4, 4)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-6)


def test_induction_layers_are_those_with_a_strong_head_strongest_first():
    scores = torch.tensor([[0.0, 0.1], [0.35, 0.0], [0.2, 0.9], [0.29, 0.29]])
    assert induction_layers(scores) == [(2, pytest.approx(0.9)), (1, pytest.approx(0.35))]
    assert induction_layers(scores, threshold=0.95) == []


def test_choose_auto_gives_induction_layers_their_slots_first():
    costs = {0: 10.0, 1: 500.0, 2: 12.0, 3: 80.0, 4: 11.0, 5: 13.0}
    induction = [(4, 0.9), (5, 0.6), (2, 0.4)]
    assert choose_auto(costs, 4, induction=induction, slots=2) == (0, 1, 4, 5)
    assert choose_auto(costs, 4, induction=induction, slots=0) == (0, 1, 3, 5)  # bypass ranking alone
    assert choose_auto(costs, 2, induction=induction, slots=1) == (0, 4)
    assert choose_auto(costs, 3, keep_first_layer=False, induction=induction, slots=1) == (1, 3, 4)
    assert choose_auto(costs, 1, induction=induction, slots=0) == (0,)
    assert copy_slots(8, 0.5) == 4 and copy_slots(4, 0.5) == 2 and copy_slots(1, 0.5) == 0
    assert copy_slots(8, 0.0) == 0 and copy_slots(8, 1.0) == 8


def test_auto_plan_keeps_the_induction_layer_and_records_it(monkeypatch):
    def fake_scores(model, sequences, bf16=False):
        scores = torch.zeros(4, 4)
        scores[2, 1] = 0.8  # layer 2 holds an induction head
        return scores

    monkeypatch.setattr(pipeline, "induction_scores", fake_scores)
    source = tiny_source("llama")
    settings = ConversionSettings(keep_attention="auto:0.5", rank_tokens=64, **FAST)
    result = convert_model(source, settings, progress=False)
    assert result.plan.kept == [0, 2]
    assert result.plan.induction == [(2, pytest.approx(0.8))]
    assert "induction layers" in result.plan.describe() and "2:0.80" in result.plan.describe()
    record = json.loads(json.dumps(result.record()))  # what conversion.json holds
    assert record["plan"]["induction"] == [[2, pytest.approx(0.8)]]
    assert "kept first: layer 2 (0.80)" in str(conversion_card(result))

    no_share = convert_model(source, ConversionSettings(keep_attention="auto:0.5", rank_tokens=64, induction_share=0.0,
                                                        **FAST), progress=False)
    assert no_share.plan.induction is None
    costs = dict(no_share.plan.ranking)
    assert no_share.plan.kept == [0, max((i for i in costs if i != 0), key=lambda i: costs[i])]


def test_induction_share_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match="--induction_share must lie in"):
        ConversionSettings(induction_share=1.5).validate()
