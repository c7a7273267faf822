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


def test_the_race_draws_as_the_multinomial_does():
    """The GPU's draw (an exponential race) against the CPU's (torch.multinomial) on one
    filtered distribution: both frequencies match the probabilities."""
    from freetoken.engine.sample import race

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, generator=g) * 2
    probs = torch.softmax(logits, 0)
    probs[probs < probs.sort().values[20]] = 0  # a filter left half the tokens
    probs /= probs.sum()
    n = 20_000
    raced = torch.tensor([race(probs, g) for _ in range(n)])
    drawn = torch.multinomial(probs, n, replacement=True, generator=g)
    for draws in (raced, drawn):
        freq = torch.bincount(draws, minlength=40).float() / n
        torch.testing.assert_close(freq, probs, atol=0.012, rtol=0)
    assert probs[raced].min() > 0  # a filtered-out token is never drawn


def test_the_race_never_draws_a_token_of_probability_zero():
    from freetoken.engine.sample import race

    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(151_936)
    probs[[5, 70_000]] = torch.tensor([0.999, 0.001])
    assert {race(probs, g) for _ in range(300)} <= {5, 70_000}


def test_a_seeded_generator_lives_on_the_logits_device():
    from freetoken.engine.sample import generator

    assert generator(None, "cpu") is None
    g = generator(7, "cpu")
    assert g is not None and g.device.type == "cpu" and g.initial_seed() == 7


@pytest.mark.cuda
def test_sampling_on_the_gpu_follows_the_distribution_and_its_seed():
    from freetoken.engine.sample import generator

    probs = torch.tensor([0.6, 0.3, 0.1], device="cuda")
    p = SamplingParams(temperature=1.0, top_p=0.85)  # drops the third token
    g = generator(0, "cuda")
    draws = [sample(probs.log(), p, g) for _ in range(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    torch.testing.assert_close(freq, torch.tensor([0.6 / 0.9, 0.3 / 0.9, 0.0]), atol=0.03, rtol=0)
    again = [sample(probs.log(), p, generator(0, "cuda")) for _ in range(5)]
    assert again == [sample(probs.log(), p, generator(0, "cuda")) for _ in range(5)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rows_sample_as_each_row_alone(device):
    """A batch's draw (``sample_rows``): greedy rows are ``sample``'s argmax (ties and NaNs
    included), a seeded or filtered row draws as it would alone with its own generator, and
    the unseeded rows without filters (one race on a GPU) follow their temperature's
    softmax."""
    from freetoken.engine.sample import generator, sample_rows

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 50, generator=g) * 2
    logits[0, [3, 9]] = 10.0  # a tie
    logits[1, 7] = float("nan")
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, seed=11),
              SamplingParams(temperature=1.0, top_k=5, seed=12), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.5)]
    plain = [4, 5]
    seen = {i: [] for i in plain}
    logits = logits.to(device)
    for _ in range(2000):
        gens = [generator(p.seed, device) for p in params]
        got = sample_rows(logits, params, gens)
        alone = [sample(logits[i], p, generator(p.seed, device)) for i, p in enumerate(params)]
        assert got[:4] == alone[:4]
        for i in plain:
            seen[i].append(got[i])
    assert got[0] == 3 and got[1] == 7
    for i in plain:
        freq = torch.bincount(torch.tensor(seen[i]), minlength=50).float() / len(seen[i])
        want = torch.softmax(logits[i].cpu() / params[i].temperature, 0)
        torch.testing.assert_close(freq, want, atol=0.03, rtol=0)


def test_the_race_over_rows_draws_each_rows_distribution():
    from freetoken.engine.sample import race_rows

    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(3, 30, generator=g) * 2, -1)
    probs[1, probs[1] < probs[1].median()] = 0  # a filtered row: those are never drawn
    n = 6000
    draws = torch.stack([race_rows(probs, g) for _ in range(n)])  # (n, 3)
    for r in range(3):
        freq = torch.bincount(draws[:, r], minlength=30).float() / n
        torch.testing.assert_close(freq, probs[r] / probs[r].sum(), atol=0.02, rtol=0)
    assert probs[1][draws[:, 1]].min() > 0
