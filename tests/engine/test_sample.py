"""Sampling filters against their definitions."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.sample import SamplingParams, sample


def test_greedy_is_argmax():
    logits = torch.randn(1000)
    assert sample(logits, SamplingParams(), None) == int(logits.argmax())


def test_greedy_breaks_ties_and_nans_as_torch_does():
    logits = torch.zeros(151_936)
    logits[[7, 90_000]] = 5.0  # a tie: the first index
    assert sample(logits, SamplingParams(), None) == int(torch.argmax(logits)) == 7
    logits[[11, 12]] = float("nan")  # NaN counts as the largest
    assert sample(logits, SamplingParams(), None) == int(torch.argmax(logits)) == 11


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(1000)
    g = torch.Generator().manual_seed(1)
    p = SamplingParams(temperature=5.0, top_k=1)
    assert all(sample(logits, p, g) == int(logits.argmax()) for _ in range(20))


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), g) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there


def test_seed_makes_sampling_repeatable():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(1)]
    b = [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(1)]
    assert a == b


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    draws = [sample(probs.log(), SamplingParams(temperature=1.0), g) for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-2), dict(max_tokens=0)])
def test_invalid_values_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), g) for _ in range(300)}
    assert seen == {0, 1}  # 0.15 < 0.5 * 0.5


def test_penalties_follow_openai_definition():
    from freetoken.engine.sample import apply_penalties

    logits = torch.zeros(5)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [1, 1, 3], p)
    assert out.tolist() == [0.0, -1.0, 0.0, -0.75, 0.0]
