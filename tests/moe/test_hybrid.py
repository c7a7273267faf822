"""Hybrid: the split policy converges on a simulated CPU/PCIe pair, each layer finds its
profile row (or falls back to a cap of 1 with a warning), and the text equals resident's."""

from __future__ import annotations

import json
import random

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.errors import ConfigError
from freetoken.moe.hybrid import HybridExperts
from freetoken.moe.offload import offload_stats
from freetoken.moe.profile import VERSION, Row, save_rows
from freetoken.moe.split import (
    PROBE_CALLS,
    PROBE_FIRST,
    REMEASURE_EVERY,
    SplitCosts,
    SplitPolicy,
)
from freetoken.moe.wall_check import (
    CHECK_ARM,
    CHECK_FIRST,
    CHECK_LONGEST,
    CHECK_SETTLE,
    CHECK_STOP,
    DECODE_ROWS,
    WallCheck,
)
from tests.models.helpers import load_ours, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180, 2, 33, 101, 8]

ARM = CHECK_SETTLE + CHECK_ARM  # a wall check arm's tokens: its untimed start, then timed
CUT = CHECK_SETTLE + CHECK_STOP  # an arm's tokens when it is CHECK_EARLY behind at CHECK_STOP


def simulate(policy: SplitPolicy, cpu_per_expert: float, pcie_per_expert: float,
             steps: int = 200, noise: float = 0.1, seed: int = 0,
             overhead: float = 0.0, first_cpu: float = 1.0, cpu_job: float = 0.0) -> list[float]:
    """A layer step with 8 misses: the CPU and the link take a known time per expert (the CPU
    ``cpu_job`` more per job, whatever its size), and handing experts to the CPU costs the
    host ``overhead`` per step. The first step that uses the CPU costs ``first_cpu`` times as
    much (first use: allocations, cold caches)."""
    rng = random.Random(seed)
    times = []
    cold = True
    for _ in range(steps):
        n = policy.n_fetch(8)
        t_pcie = n * pcie_per_expert * (1 + noise * rng.uniform(-1, 1))
        t_cpu = ((8 - n) * cpu_per_expert + cpu_job * (n < 8)) * (1 + noise * rng.uniform(-1, 1))
        o = overhead if n < 8 else 0.0
        if n < 8 and cold:
            t_cpu, o, cold = t_cpu * first_cpu, (o + cpu_per_expert) * first_cpu, False
        policy.observe(8 - n, t_cpu, n, t_pcie, o)
        times.append(max(t_cpu, t_pcie) + o)
    return times


def best_step(cpu: float, pcie: float, overhead: float = 0.0, cpu_job: float = 0.0) -> float:
    return min(max(n * pcie, (8 - n) * cpu + cpu_job) + overhead if n < 8 else n * pcie
               for n in range(9))


@pytest.mark.parametrize("ratio", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("start", [None, 0.0, 0.9])
def test_online_split_converges_to_equal_finish(ratio, start):
    """CPU ``ratio`` times slower per expert than the link: balance at f = ratio / (1 + ratio)
    (to within one of the 8 misses), from a profile fraction that is wrong (0.0 or 0.9) or
    absent (cap 1)."""
    policy = SplitPolicy(fraction=start, max_fetch=None if start is not None else 1)
    times = simulate(policy, cpu_per_expert=ratio, pcie_per_expert=1.0)
    assert policy.fraction == pytest.approx(ratio / (1 + ratio), abs=1 / 8 + 0.01)
    assert sum(times[-50:]) / 50 <= best_step(ratio, 1.0) * 1.2  # within noise of the best
    # never worse than offload alone (all fetched) or cpu alone
    assert sum(times[-50:]) / 50 <= min(8 * 1.0, 8 * ratio) * 1.1


@pytest.mark.parametrize("start", [0.3, 0.6])
def test_online_split_drops_a_cpu_half_that_costs_more_than_it_saves(start):
    """Handing work to the CPU costs the host 3 units a step, more than the CPU saves: the
    split moves to fetching everything (offload's time), and stays there."""
    policy = SplitPolicy(fraction=start, max_fetch=None)
    times = simulate(policy, cpu_per_expert=1.0, pcie_per_expert=0.5, overhead=3.0, steps=300)
    assert policy.fraction == 1.0
    assert sum(times[-50:]) / 50 <= 8 * 0.5 * 1.15  # offload: 8 fetches


def test_a_slow_first_cpu_call_does_not_keep_the_cpu_idle():
    """The first call that uses the CPU costs 20 times its due (a warm-up): that measurement
    is not kept, so the split still finds the balance; and a side left idle is probed again
    soon, then less and less often while it keeps losing."""
    policy = SplitPolicy(fraction=0.5, max_fetch=None)
    times = simulate(policy, cpu_per_expert=1.0, pcie_per_expert=1.0, first_cpu=20.0)
    assert policy.fraction == pytest.approx(0.5, abs=1 / 8 + 0.01)
    assert sum(times[-50:]) / 50 <= best_step(1.0, 1.0) * 1.2



@pytest.mark.parametrize("start", [1.0, 0.3])
def test_a_losing_side_is_probed_soon_then_less_often(start):
    """A CPU 5x slower per expert, with overhead, from all-fetched or from a profile that gave
    it most misses: once idle, it is probed after 8 calls, then after twice as many each time
    it still loses, up to REMEASURE_EVERY."""
    losing = SplitPolicy(fraction=start, max_fetch=None)
    used = []
    for i in range(1200):
        n = losing.n_fetch(8)
        if n < 8:
            used.append(i)
        losing.observe(8 - n, 5.0 * (8 - n), n, 1.0 * n, 3.0 if n < 8 else 0.0)
    assert losing.fraction == 1.0
    gaps = [b - a for a, b in zip(used, used[1:], strict=False) if b - a > 1]  # idle stretches
    assert gaps[0] == 9 and gaps[1] == 17 and gaps[2] == 33  # probe after 8, 16, 32 idle calls
    assert max(gaps) == REMEASURE_EVERY + 1 and gaps == sorted(gaps)


@pytest.mark.parametrize("start", [1.0, 0.9, 0.4])
def test_a_cpu_with_a_fixed_cost_per_job_is_not_judged_by_one_expert(start):
    """The CPU takes 3.0 a job plus 0.4 an expert against the link's 1.0 an expert: a job of
    one expert costs 3.4 (judged per expert, the CPU loses by far), but four cost 4.6 while
    the link fetches the other four, against 8.0 for fetching all eight. From all-fetched (a
    probe with the profile's share), from a split that hands the CPU one expert, or from a
    good one, the split settles on that CPU share, and the fitted job time is right there."""
    policy = SplitPolicy(fraction=start, max_fetch=None, probe_fraction=0.4)
    times = simulate(policy, cpu_per_expert=0.4, pcie_per_expert=1.0, cpu_job=3.0, steps=400)
    best = best_step(0.4, 1.0, cpu_job=3.0)
    assert best < 8.0  # the CPU pays here
    assert sum(times[-50:]) / 50 <= best * 1.1
    on_cpu = 8 - policy.n_fetch(8)
    assert on_cpu >= 3
    costs = policy.costs
    assert costs.l_cpu > 0.5 and costs.l_cpu + on_cpu * costs.c_cpu == pytest.approx(
        3.0 + 0.4 * on_cpu, rel=0.15)


def test_split_without_online_correction_stays_put():
    policy = SplitPolicy(fraction=0.9, max_fetch=None, online=False)
    simulate(policy, cpu_per_expert=1.0, pcie_per_expert=1.0, steps=20)
    assert policy.fraction == 0.9 and policy.n_fetch(10) == 9
    assert SplitPolicy(fraction=0.5, max_fetch=2).n_fetch(10) == 2


def simulate_layers(policies: list[SplitPolicy], cpu_per_expert, pcie_per_expert: float,
                    steps: int, overhead: float = 0.0, cpu_job: float = 0.0, noise: float = 0.1,
                    seed: int = 0) -> list[list[float]]:
    """Decode steps of ``len(policies)`` layers with 8 misses each, in the engine's order: a
    layer's call plans its split, and its times reach the policy at its next call.
    ``cpu_per_expert(layer, job)``: the CPU's time per expert of the layer's ``job``-th CPU
    job. Returns each step's per-layer call times."""
    rng = random.Random(seed)
    jobs = [0] * len(policies)
    last: list[tuple[int, float, int, float, float] | None] = [None] * len(policies)
    out = []
    for _ in range(steps):
        times = []
        for i, policy in enumerate(policies):
            if last[i] is not None:
                policy.observe(*last[i])
            n = policy.n_fetch(8)
            t_pcie = n * pcie_per_expert * (1 + noise * rng.uniform(-1, 1))
            t_cpu = 0.0
            if n < 8:
                t_cpu = ((8 - n) * cpu_per_expert(i, jobs[i]) + cpu_job) \
                    * (1 + noise * rng.uniform(-1, 1))
                jobs[i] += 1
            o = overhead if n < 8 else 0.0
            last[i] = (8 - n, t_cpu, n, t_pcie, o)
            times.append(max(t_cpu, t_pcie) + o)
        out.append(times)
    return out


def shared_policies(layers: int, fraction: float | None, **kw) -> list[SplitPolicy]:
    costs = SplitCosts(layers=layers)
    return [SplitPolicy(fraction, None if fraction is not None else 1, costs=costs, **kw)
            for _ in range(layers)]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _checked_run(layers: int, tokens: int, split_s: float, fetch_s: float,
                 prefill_at: int = -1, idle_at: int = -1, rows_from: tuple[int, int] = (-1, 1),
                 switch_s: float = 0.0, profile: float | None = None,
                 profile_s: float = 0.0, cpu_s: float = 200e-6,
                 counts: list[list[int]] | None = None, start_fetch: bool = False,
                 ) -> tuple[list[SplitPolicy], WallCheck, list[int]]:
    """``layers`` policies of one kind whose model gives the CPU half of 8 misses (a fixed
    0.5, nothing observed); each decode call takes ``split_s`` when the CPU had a share and
    ``fetch_s`` when all 8 were fetched, by a fake clock. Returns the policies, the check and
    each token's count of calls that gave the CPU nothing. ``idle_at``: the engine sits idle
    for a second before that token; ``rows_from``: (token, rows) the batch has from then on;
    ``switch_s``: what a layer's call costs more when it fetches all and its last call did not,
    or the other way round. ``cpu_s``: a call with every miss on the CPU (the cpu arm);
    ``profile``: the profile's fetched share, an arm held from the start, whose calls
    (``profile * 8`` fetched) take ``profile_s``; ``counts`` gets each token's fetch
    counts; ``start_fetch``: the check starts holding all-fetch (a decode check lost)."""
    clock = _Clock()
    check = WallCheck(layers=layers, clock=clock)
    check.use_profile(profile)
    if start_fetch:
        check.start_fetch()
    costs = SplitCosts(layers=layers, check=check)
    policies = [SplitPolicy(0.5, None, costs=costs) for _ in range(layers)]
    fetched_all, was_all = [], [False] * layers
    for token in range(tokens):
        rows = rows_from[1] if 0 <= rows_from[0] <= token else 1
        rows = DECODE_ROWS + 1 if token == prefill_at else rows
        clock.now += 1.0 if token == idle_at else 0.0
        count, ns = 0, []
        for i, policy in enumerate(policies):
            n = policy.n_fetch(8, rows)
            count += n == 8
            ns.append(n)
            took = {8: fetch_s, 4: split_s, 0: cpu_s}.get(n, profile_s)
            clock.now += took * (50 if rows > 1 else 1)
            clock.now += switch_s if (n == 8) != was_all[i] else 0.0
            was_all[i] = n == 8
        fetched_all.append(count)
        if counts is not None:
            counts.append(ns)
    return policies, check, fetched_all


def test_the_wall_check_benches_a_cpu_share_that_slows_the_step():
    """The model says the CPU pays, the steps say all-fetch is 10 % faster (the small box:
    hybrid 0.93x offload): after CHECK_FIRST tokens, ARM tokens of the held split, as many
    all-fetch and fewer timed all on the CPU (twice as slow, it stops at CHECK_STOP), the
    CPU gets nothing; the next check comes twice as late and confirms it (all-fetch, now
    held, first; the cpu arm sits it out)."""
    layers = 6
    first = CHECK_FIRST + 2 * ARM + CUT
    second = first + 2 * CHECK_FIRST
    _, check, fetched_all = _checked_run(layers, second + 2 * ARM + 4,
                                         split_s=110e-6, fetch_s=100e-6)
    assert fetched_all[:CHECK_FIRST + ARM] == [0] * (CHECK_FIRST + ARM)  # the model's split
    assert fetched_all[CHECK_FIRST + ARM:CHECK_FIRST + 2 * ARM] == [layers] * ARM
    assert fetched_all[CHECK_FIRST + 2 * ARM:first] == [0] * CUT  # the cpu's
    assert check.benched and fetched_all[first:second + ARM] == [layers] * (
        2 * CHECK_FIRST + ARM)
    assert fetched_all[second + ARM:second + 2 * ARM] == [0] * ARM  # the split's
    assert fetched_all[-4:] == [layers] * 4  # confirmed at the second check
    assert [v.choice for v in check.verdicts] == ["fetch", "fetch"]
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 110e-6, "cpu": 200e-6})
    assert set(check.verdicts[1].seconds) == {"fetch", "split"}
    assert check.arm_calls == (4 * ARM + CUT) * layers  # the search, in calls


def test_the_wall_check_keeps_a_cpu_share_that_pays():
    """The steps agree with the model (the split 15 % faster): after each check the model's
    split runs again, and the wait doubles up to CHECK_LONGEST tokens; all-fetch (18 % slower
    than the held split, timed first) stops at CHECK_STOP, and so does the cpu arm (2x slower),
    which sits every other check out."""
    _, check, fetched_all = _checked_run(4, 400, split_s=85e-6, fetch_s=100e-6)
    assert not check.benched
    # four fetch arms, each wait twice the last (16, 32, 64, 128 tokens); 3, 2, 3 arms before
    assert sum(1 for c in fetched_all if c) == 4 * CUT
    last = 15 * CHECK_FIRST + 3 * ARM + 5 * CUT  # the fourth check: the split's, all-fetch
    assert not any(fetched_all[last:last + ARM])
    assert fetched_all[last + ARM:last + ARM + CUT] == [4] * CUT
    assert not any(fetched_all[last + ARM + CUT:])
    assert check._wait == 16 * CHECK_FIRST <= CHECK_LONGEST


def test_a_split_whose_decode_check_lost_starts_at_all_fetch():
    """The profile's decode check measured hybrid slower than offload (the nvfp4 Gemma-4
    file: the profile's split 702 us a layer call, all-fetch 566, the model's 650): all-fetch
    is held from the first token, and the first check times it and the model's split only
    (the profile's and the cpu arm sit it out), then holds all-fetch; the next check tries
    every arm again."""
    layers = 4
    first = CHECK_FIRST + 2 * ARM
    _, check, fetched_all = _checked_run(layers, first + 2 * CHECK_FIRST + 1, split_s=110e-6,
                                         fetch_s=100e-6, profile=0.25, profile_s=124e-6,
                                         start_fetch=True)
    assert fetched_all[:CHECK_FIRST + ARM] == [layers] * (CHECK_FIRST + ARM)
    assert fetched_all[CHECK_FIRST + ARM:first] == [0] * ARM  # the model's split, whole
    assert fetched_all[first:] == [layers] * (2 * CHECK_FIRST + 1)
    assert [v.choice for v in check.verdicts] == ["fetch"]
    assert check.verdicts[0].seconds == pytest.approx({"fetch": 100e-6, "split": 110e-6})
    # two arms' calls (the held arm's too); the check ends in the next token's first calls
    assert 2 * ARM * layers <= check.arm_calls < (2 * ARM + 1) * layers
    assert [a for a in check.arms if check._sits(a)] == []  # back at the next check


def test_the_wall_check_holds_the_profiles_split_until_an_arm_beats_it():
    """The model's split (half of 8 misses fetched) loses to all-fetch, but the profile's
    (a quarter) beats both, as on the H100 box (the model's early split took 740 us a layer
    call, the profile's 440): the profile's 2 fetched a call are held from the start; the
    first check times it first, then every other arm, each stopped at CHECK_STOP (CHECK_EARLY
    behind it), and keeps it; at the next only the model's split runs beside it (the others
    lost by more than CHECK_DROP). The model's own fraction is kept for its arm."""
    layers, counts = 4, []
    first = CHECK_FIRST + ARM + 3 * CUT
    second = first + 2 * CHECK_FIRST
    policies, check, _ = _checked_run(layers, second + 2 * ARM + 4, split_s=130e-6,
                                      fetch_s=100e-6, profile=0.25, profile_s=80e-6,
                                      counts=counts)
    assert counts[:CHECK_FIRST] == [[2] * layers] * CHECK_FIRST
    arms = [[n] * layers for n, calls in ((2, ARM), (8, CUT), (4, CUT), (0, CUT))
            for _ in range(calls)]
    assert counts[CHECK_FIRST:first] == arms
    assert counts[first:second] == [[2] * layers] * (2 * CHECK_FIRST)
    assert counts[second:] == [[2] * layers] * ARM + [[4] * layers] * CUT + [
        [2] * layers] * (ARM + 4 - CUT)
    assert [v.choice for v in check.verdicts] == ["profile", "profile"]
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 130e-6, "cpu": 200e-6, "profile": 80e-6})
    assert all(p.fraction == 0.5 and p.share == 0.25 and not p.all_fetch for p in policies)


def test_an_arm_clearly_behind_early_stops_there():
    """An arm CHECK_EARLY slower than the fastest this check has timed, CHECK_STOP calls into
    its timed ones, stops (its time so far goes to the verdict); one slower by less runs whole,
    and so does the first arm (the held one), with nothing to compare it with."""
    layers, counts = 3, []
    end = CHECK_FIRST + ARM + 2 * CUT + 1
    _, check, _ = _checked_run(layers, end, split_s=112e-6, fetch_s=130e-6, cpu_s=300e-6,
                               counts=counts)
    fetched = [row[0] for row in counts]
    assert fetched[CHECK_FIRST:CHECK_FIRST + ARM] == [4] * ARM  # the held split: whole
    assert fetched[CHECK_FIRST + ARM:CHECK_FIRST + ARM + CUT] == [8] * CUT  # 16 % behind
    cpu = fetched[CHECK_FIRST + ARM + CUT:]
    assert cpu[:CUT] == [0] * CUT and cpu[CUT] == 4  # 2.7x the split's: stopped, then held
    assert [v.choice for v in check.verdicts] == ["split"]
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 130e-6, "split": 112e-6, "cpu": 300e-6})
    counts = []
    _checked_run(layers, CHECK_FIRST + 2 * ARM + 1, split_s=112e-6, fetch_s=125e-6,
                 counts=counts)
    fetched = [row[0] for row in counts]
    assert fetched[CHECK_FIRST + ARM:CHECK_FIRST + 2 * ARM] == [8] * ARM  # 12 % behind: whole


def test_an_arm_must_beat_the_held_one_by_the_margin():
    """The profile's split is held from the start: the model's 1 % faster does not replace
    it (CHECK_MARGIN), 10 % faster does; all-fetch fastest benches the CPU."""
    tokens, profile = CHECK_FIRST + 4 * ARM + 2, dict(profile=0.25, profile_s=100e-6)
    _, check, _ = _checked_run(4, tokens, split_s=99e-6, fetch_s=120e-6, **profile)
    assert check.choice == "profile" and check.fraction == 0.25
    _, check, _ = _checked_run(4, tokens, split_s=90e-6, fetch_s=120e-6, **profile)
    assert check.choice == "split" and check.fraction is None
    _, check, _ = _checked_run(4, tokens, split_s=100e-6, fetch_s=80e-6, **profile)
    assert check.benched and check.fraction == 1.0


def test_every_miss_on_the_cpu_is_held_where_that_is_fastest():
    """The cpu arm (nothing fetched) 20 % faster than the model's split: it is held, and at
    the next check, timed first, all-fetch (50 % slower) sits out while the model's split runs
    again (until CHECK_STOP: 25 % behind)."""
    layers, counts = 4, []
    first = CHECK_FIRST + 2 * ARM + CUT
    second = first + 2 * CHECK_FIRST
    _, check, _ = _checked_run(layers, second + 2 * ARM + 4, split_s=100e-6, fetch_s=150e-6,
                               cpu_s=80e-6, counts=counts)
    assert counts[CHECK_FIRST + ARM + CUT:first] == [[0] * layers] * ARM  # the cpu arm
    assert counts[first:second + ARM] == [[0] * layers] * (2 * CHECK_FIRST + ARM)  # held
    assert counts[second + ARM:second + ARM + CUT] == [[4] * layers] * CUT  # the model's
    assert [v.choice for v in check.verdicts] == ["cpu", "cpu"]
    assert set(check.verdicts[1].seconds) == {"split", "cpu"} and check.fraction == 0.0


def test_an_arm_that_keeps_losing_sits_out_twice_as_many_checks():
    """All on the CPU twice as slow as the model's split (a small box): it is timed at the
    first check, then sits out one check, then two, then four, so on a box where it never
    pays it costs ever fewer checks."""
    _, check, _ = _checked_run(4, 1200, split_s=85e-6, fetch_s=100e-6)
    ran = ["cpu" in v.seconds for v in check.verdicts]
    assert ran == [True, False, True, False, False, True]
    assert check.choice == "split"


def test_the_switch_between_arms_is_not_timed():
    """The first call of a layer after a switch costs a millisecond (the pool woken after the
    all-fetch arm, slots picked for the other arm): over one 8-token arm that would make a
    split 15 % faster look slower than all-fetch. The arms' untimed starts leave it out."""
    _, check, _ = _checked_run(4, CHECK_FIRST + 3 * ARM + 2, split_s=85e-6, fetch_s=100e-6,
                               switch_s=1e-3)
    assert not check.benched
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 85e-6, "cpu": 200e-6})


def test_a_prefill_call_restarts_the_arm_it_falls_in():
    """A prompt's call (many rows) in the middle of an arm is not timed: the arm starts again,
    so a 50x longer call does not decide the verdict."""
    arm = CHECK_FIRST + 3 + ARM  # two tokens, the prompt's call, then the whole arm
    tokens = arm + 2 * ARM + 2
    _, check, fetched_all = _checked_run(4, tokens, split_s=110e-6,
                                         fetch_s=100e-6, prefill_at=CHECK_FIRST + 2)
    assert fetched_all[:arm] == [0] * arm  # the held split, its arm again after the prompt
    assert fetched_all[arm:arm + ARM] == [4] * ARM  # all-fetch
    assert fetched_all[arm + ARM:arm + ARM + CUT] == [0] * CUT  # the cpu's
    assert check.benched and fetched_all[arm + ARM + CUT:] == [4] * (tokens - arm - ARM - CUT)


def test_an_idle_engine_inside_an_arm_restarts_it():
    """A second without requests in the split's arm (the split 15 % faster) would make the
    split look slower than all-fetch and bench the CPU: the arm starts again instead."""
    first = CHECK_FIRST + 3 * ARM
    _, check, fetched_all = _checked_run(4, first + 6, split_s=85e-6, fetch_s=100e-6,
                                         idle_at=CHECK_FIRST + ARM + 3)
    assert not check.benched
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 85e-6, "cpu": 200e-6})
    assert fetched_all[first + 3:] == [0] * 3  # the arm ran 3 tokens more, then the split


def test_a_batch_that_changes_inside_the_check_starts_both_arms_again():
    """A request joins in the all-fetch arm (two rows a call from then on, which take longer):
    the held split's arm is timed again at two rows before all-fetch is compared with it."""
    restart = CHECK_FIRST + ARM + 3
    _, check, fetched_all = _checked_run(4, restart + 3 * ARM + 2, split_s=85e-6,
                                         fetch_s=100e-6, rows_from=(restart, 2))
    assert fetched_all[CHECK_FIRST + ARM:restart] == [4] * 3
    assert fetched_all[restart:restart + ARM] == [0] * ARM  # the split's again
    assert fetched_all[restart + ARM:restart + ARM + CUT] == [4] * CUT  # 18 % behind: half
    assert len(check.verdicts) == 1 and not check.benched


def test_steps_that_fetch_every_miss_are_not_timed_by_the_wall_check():
    """A greedy request's steps fetch every miss (``SplitCosts.fetch_all``) whatever arm the
    check holds, and take their own time (here three times a call, too short a stretch to
    count as the engine sitting idle): they count in no arm, and the arm they fall in (the
    split's) starts again after them, so every arm times its own calls alone."""
    layers = 3
    clock = _Clock()
    check = WallCheck(layers=layers, clock=clock)
    costs = SplitCosts(layers=layers, check=check)
    policies = [SplitPolicy(0.5, None, costs=costs) for _ in range(layers)]
    greedy = range(CHECK_FIRST + ARM + 4, CHECK_FIRST + ARM + 5)  # inside the split's arm
    for token in range(CHECK_FIRST + 4 * ARM):
        costs.fetch_all = token in greedy
        for policy in policies:
            n = policy.n_fetch(8)
            assert n == 8 or not costs.fetch_all
            clock.now += 300e-6 if costs.fetch_all else {8: 100e-6, 4: 110e-6, 0: 200e-6}[n]
        if check.verdicts:
            break
    assert len(check.verdicts) == 1
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 110e-6, "cpu": 200e-6})


def test_a_step_said_to_fetch_every_miss_does_so_and_is_timed_in_the_all_fetch_arm():
    """Decode graphs made for steps that fetch every miss run a step only when each hybrid
    layer says its next call will (``fetches_next``: the kind's calls of one step). Over a
    run where all-fetch wins every check, a step said to fetch all fetches 8 of 8 misses in
    every layer, and each of its calls falls in the wait or in the all-fetch arm: no other arm
    begins inside it. Every step of the waits between checks is said to, and so is every step
    of the all-fetch arm but the one it begins in (and, when it is not the held arm, the one
    CHECK_STOP calls in), so that arm is timed as held all-fetch runs; its calls, made as
    such steps make them (``fetching``), still count in it."""
    layers = 5
    clock = _Clock()
    check = WallCheck(layers=layers, clock=clock)
    costs = SplitCosts(layers=layers, check=check)
    policies = [SplitPolicy(0.5, None, costs=costs) for _ in range(layers)]
    said = []
    first = CHECK_FIRST + 2 * ARM + CUT  # the first check's verdict falls in this step
    for _ in range(first + 2 * CHECK_FIRST + 2 * ARM + 2 * CHECK_FIRST):
        fetching = all(p.fetches_next(costs.layers) for p in policies)
        said.append(fetching)
        phases = set()
        for policy in policies:
            policy.fetching = fetching
            n = policy.n_fetch(8)
            policy.fetching = False
            phases.add(check.phase)
            assert n == 8 or not fetching
            clock.now += {8: 100e-6, 4: 110e-6, 0: 200e-6}[n]
        assert phases <= {"wait", "fetch"} or not fetching
    assert [v.choice for v in check.verdicts] == ["fetch", "fetch"]
    assert check.verdicts[0].seconds == pytest.approx(
        {"fetch": 100e-6, "split": 110e-6, "cpu": 200e-6})
    fetch = CHECK_FIRST + ARM  # the all-fetch arm begins here, after the held split's
    assert not any(said[:fetch + 1])  # the model's split, its arm, the step all-fetch begins in
    # the all-fetch arm, but for the step that crosses its CHECK_STOP mark: it might stop there
    # (CHECK_EARLY behind the split's), and that step's last calls be the cpu arm's
    assert said[fetch + 1:fetch + ARM] == [True] * (CUT - 1) + [False] + [True] * (ARM - CUT - 1)
    assert not any(said[fetch + ARM:first + 1])  # the cpu arm
    second = first + 2 * CHECK_FIRST  # the second check's all-fetch arm begins here
    assert all(said[first + 1:second]) and not said[second]
    assert all(said[second + 1:second + ARM]) and not said[second + ARM]
    assert said[-1]  # the wait after the second check
    fixed = SplitPolicy(1.0, None, online=False)
    assert fixed.fetches_next(layers) and not SplitPolicy(0.5, None, online=False
                                                          ).fetches_next(layers)
    greedy = SplitCosts(layers=layers, check=WallCheck(layers=layers), fetch_all=True)
    assert SplitPolicy(0.5, None, costs=greedy).fetches_next(layers)


def test_noisy_cpu_times_are_split_by_the_kinds_costs():
    """Twelve layers on a small box: the CPU costs 2.6 a job plus 2.6 an expert against the
    link's 1.0, times vary by +-50 %, and one CPU job in ten takes four times as long (a
    wake-up, another process). Each layer fitting its own costs from its few recent jobs
    (as on an H200 run, where two layers' fits gave 244 and 0 us per expert against 40-60
    for the others) decodes slower than offload; the costs shared by the kind's layers do
    not."""
    def late_steps(make) -> float:
        total = 0.0
        for seed in range(4):
            def cpu(layer: int, job: int, seed: int = seed) -> float:
                return 2.6 * (4 if random.Random(f"{seed}:{layer}:{job}").random() < 0.1
                              else 1)
            steps = simulate_layers(make(), cpu, 1.0, steps=150, noise=0.5, cpu_job=2.0,
                                    overhead=0.2, seed=seed)
            total += sum(sum(t) for t in steps[20:]) / 130
        return total / 4

    offload = 12 * 8 * 1.0
    alone = late_steps(lambda: [SplitPolicy(0.5, None) for _ in range(12)])
    shared = late_steps(lambda: shared_policies(12, 0.5))
    assert alone > offload  # what the layers' own fits did
    assert shared < offload and shared < alone * 0.97


def test_a_kinds_idle_cpu_is_probed_once_for_all_its_layers():
    """A CPU 5x slower per expert, with overhead: every layer goes all-fetch, and the CPU is
    probed by PROBE_CALLS consecutive layer calls at a time (the first runs cold), then
    after twice as many steps each time, up to REMEASURE_EVERY steps: about as often per
    step as one layer alone probed it, not twelve times as often."""
    def probes(policies: list[SplitPolicy]) -> list[tuple[int, int]]:
        seen = []
        for step in range(1500):
            for i, p in enumerate(policies):
                n = p.n_fetch(8)
                if p.probing == "cpu":
                    seen.append((step, i))
                p.observe(8 - n, 5.0 * (8 - n), n, 1.0 * n, 3.0 if n < 8 else 0.0)
        assert all(p.fraction == 1.0 for p in policies)
        return seen

    shared = probes(shared_policies(12, 0.3))
    assert len(shared) % PROBE_CALLS == 0
    for k in range(0, len(shared), PROBE_CALLS):  # a probe's calls follow one another
        (s0, l0), *rest = shared[k:k + PROBE_CALLS]
        assert [s * 12 + layer for s, layer in rest] == [
            s0 * 12 + l0 + j for j in range(1, PROBE_CALLS)]
    steps = [s for s, _ in shared[::PROBE_CALLS]]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    # (a gap may be a step off: the probe falls to the next layer's call that is due)
    assert 2 * PROBE_FIRST <= gaps[0] <= 2 * PROBE_FIRST + 1
    assert all(a - 1 <= b <= 2 * a + 1 for a, b in zip(gaps, gaps[1:], strict=False))
    assert REMEASURE_EVERY <= max(gaps) <= REMEASURE_EVERY + 1
    alone = probes([SplitPolicy(0.3, None) for _ in range(12)])
    assert len(alone) > 8 * len(shared)


def test_hybrid_layers_of_one_kind_share_their_split_costs(q8_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    _, layers = _hybrid(q8_gguf)
    costs = layers[0].policy.costs
    assert len(layers) == 2 and all(m.policy.costs is costs for m in layers)
    assert costs.layers == 2
    # one wall check for the kind, counting both layers' calls toward its tokens
    assert costs.check is not None and costs.check.layers == 2 and not costs.check.benched


def test_the_wall_check_can_be_left_out(q8_gguf, tmp_path, monkeypatch):
    """FREETOKEN_WALL_CHECK=off: the online cost model alone splits (an A/B of the check on
    one box); a value that is neither on nor off is refused by name."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    monkeypatch.setenv("FREETOKEN_WALL_CHECK", "off")
    _, layers = _hybrid(q8_gguf)
    assert layers[0].policy.costs.check is None and not layers[0].policy.all_fetch
    monkeypatch.setenv("FREETOKEN_WALL_CHECK", "maybe")
    with pytest.raises(ConfigError, match="FREETOKEN_WALL_CHECK='maybe'"):
        _hybrid(q8_gguf)


@pytest.fixture(scope="module")
def q8_gguf(tiny_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("hybrid") / "q8.gguf"
    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), out,
                           lambda n, s: "q8_0" if ".experts." in n else "f32")


def _hybrid(path, threads: int = 1, max_fetch: int | str = "auto"):
    model = load_ours(path, strategy="hybrid", cache=CacheSizing("size", 3), threads=threads,
                      max_fetch=max_fetch)
    return model, [m for m in model.modules() if isinstance(m, HybridExperts)]


def test_each_layer_finds_its_row(q8_gguf, tmp_path, monkeypatch, caplog):
    profile = tmp_path / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(profile))
    key = "gguf[down_type=8,gate_up_type=8]:64x32:top2:t1"
    row = Row(100.0, 30.0, 90.0, 30.0, {"isa": "test"})
    save_rows({key: row}, profile)
    assert json.loads(profile.read_text())["version"] == VERSION
    with caplog.at_level("INFO"):
        _, layers = _hybrid(q8_gguf)
    assert [m.shape.layer for m in layers] == [0, 2]
    assert all(m.policy.fraction == pytest.approx(0.25) and m.policy.max_fetch is None
               for m in layers)
    assert f"hybrid on 2 q8_0 layers at 25.0 % (row {key})" in caplog.text
    check = layers[0].policy.costs.check  # the row's split: an arm, held from the start
    assert check is not None and check.profile == pytest.approx(0.25)
    assert check.arms == ("fetch", "split", "cpu", "profile") and check.choice == "profile"
    # the nearest thread count serves a server with another worker count
    profile.unlink()
    save_rows({key.replace(":t1", ":t4"): row}, profile)
    caplog.clear()
    with caplog.at_level("INFO"):
        _, layers = _hybrid(q8_gguf)
    assert layers[0].policy.fraction == pytest.approx(0.25)
    assert "nearest thread count" in caplog.text
    # no row for the format: a cap of 1, with a warning naming the key
    profile.unlink()
    save_rows({"bf16:64x32:top2:t1": row}, profile)
    caplog.clear()
    _, layers = _hybrid(q8_gguf)
    assert all(m.policy.fraction is None and m.policy.max_fetch == 1 for m in layers)
    assert f"no row for {key}" in caplog.text and "ft bench bw --model" in caplog.text


def test_damaged_profile_falls_back_to_cap_1(q8_gguf, tmp_path, monkeypatch, caplog):
    profile = tmp_path / "benchbw.json"
    profile.write_text("{not json")
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(profile))
    _, layers = _hybrid(q8_gguf, max_fetch=2)
    assert all(m.policy.max_fetch == 2 for m in layers)
    assert str(profile) in caplog.text and "ft bench bw" in caplog.text


@pytest.mark.parametrize("path", ["grouped", "gathered"])
@pytest.mark.parametrize("fmt", ["hf", "q8_0"])
def test_hybrid_logits_close_to_resident(tiny_qwen3_moe, q8_gguf, tmp_path, monkeypatch, fmt,
                                         path, request):
    """Grouped: the CPU's path. Gathered: the GPU's (host plan, published slot table, CPU
    result added after the gather), run on the CPU."""
    if path == "gathered":
        request.getfixturevalue("gather_on_cpu")
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    path = tiny_qwen3_moe if fmt == "hf" else q8_gguf
    resident = our_logits(load_ours(path), IDS, prefill=4)
    model, layers = _hybrid(path)
    hybrid = our_logits(model, IDS, prefill=4)
    torch.testing.assert_close(hybrid, resident, atol=3e-3, rtol=3e-3)
    assert torch.equal(hybrid.argmax(-1), resident.argmax(-1))
    stats = offload_stats(model)
    assert stats is not None
    assert stats["cpu_experts"] > 0 and stats["misses"] > 0 and stats["hits"] > 0
    assert all("fetch_fraction" in s for s in stats["layers"].values())
    assert isinstance(layers[0], HybridExperts)


def test_the_cpu_arm_runs_every_pair_on_the_pool(q8_gguf, tmp_path, monkeypatch,
                                                 gather_on_cpu):
    """The wall check holding its cpu arm: a gathered call puts every routed pair on the CPU
    pool (hits too, as the cpu strategy does), fetches nothing and publishes an empty slot
    table; the logits stay resident's."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    resident = our_logits(load_ours(q8_gguf), IDS, prefill=1)  # decode calls only
    model, layers = _hybrid(q8_gguf)
    check = layers[0].policy.costs.check
    assert check is not None
    check.hold("cpu")
    assert all(m.policy.all_cpu and not m.policy.all_fetch for m in layers)
    hybrid = our_logits(model, IDS, prefill=1)
    torch.testing.assert_close(hybrid, resident, atol=3e-3, rtol=3e-3)
    assert torch.equal(hybrid.argmax(-1), resident.argmax(-1))
    stats = offload_stats(model)
    assert stats is not None
    assert stats["cpu_experts"] > 0 and stats["bytes_fetched"] == 0 and stats["hits"] == 0


def test_the_cpu_arms_times_do_not_reach_the_splits_model(q8_gguf, tmp_path, monkeypatch,
                                                         gather_on_cpu):
    """Calls the cpu arm ran (every pair on the pool) are not the split's: when the check
    moves on to the split, the model learns nothing from them, only from the split's own
    calls."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    m = _hybrid(q8_gguf)[1][0]
    seen: list[tuple] = []
    monkeypatch.setattr(m.policy, "observe", lambda *a: seen.append(a))
    check = m.policy.costs.check
    assert check is not None
    g = torch.Generator().manual_seed(0)

    def call() -> None:
        x = torch.randn(1, m.shape.hidden, generator=g)
        ids = torch.randperm(m.shape.num_experts, generator=g)[:m.shape.top_k].view(1, -1)
        m._plan(x, ids, torch.rand(1, m.shape.top_k, generator=g))
        m._finish()

    check.hold("cpu")
    for _ in range(3):
        call()
    check.hold("split")
    call()
    assert seen == []
    call()
    assert len(seen) == 1  # the split's first call


def _eager_and_between_pieces(layers: list[HybridExperts], g: torch.Generator,
                              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """One call of 2 experts planned eagerly on ``layers[0]`` and between graph pieces on
    ``layers[1]`` (from host copies of ``dtype``; its own inputs NaN, so it must read the
    copies): (x, ids, w, the eager CPU result, the piece's, the host copies' cpu_out)."""
    from freetoken.moe.host_steps import HostCopies

    # 2 experts: within 3 slots; values the host copies' dtype holds exactly
    x = torch.randn(1, layers[0].shape.hidden, generator=g).to(dtype).float()
    ids = torch.randperm(layers[0].shape.num_experts, generator=g)[:2].view(1, 2)
    w = torch.rand(1, 2, generator=g).to(dtype).float()
    assert layers[0]._plan(x, ids, w) is None  # the CPU's share is left running
    eager = layers[0]._finish()
    host = HostCopies(x.to(dtype), ids.clone(), w.to(dtype), torch.full(x.shape, float("nan")))
    nan = float("nan")
    assert layers[1]._plan(torch.full_like(x, nan), ids, torch.full_like(w, nan), host) is None
    planned = layers[1]._finish()
    assert layers[1]._finish() is None  # collected once
    return x, ids, w, eager, planned, host.cpu_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_between_graph_pieces_equals_the_eager_plan(q8_gguf, tmp_path, monkeypatch,
                                                        gather_on_cpu, dtype):
    """Between graph pieces a plan reads host copies of its inputs (of the model's dtype; the
    CPU's job, checked once per set of copies, reads them as float32) and the CPU pool writes
    its share into the pinned buffer the next piece copies in: the same numbers as the eager
    plan, with the same fetches."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    layers = [_hybrid(q8_gguf)[1][0] for _ in range(2)]
    for m in layers:
        m.policy = SplitPolicy(0.5, None, online=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):  # evictions and CPU shares all along
        x, ids, w, eager, planned, cpu_out = _eager_and_between_pieces(layers, g, dtype)
        if eager is None:
            assert planned is None
            continue
        assert planned is cpu_out
        torch.testing.assert_close(planned, eager, rtol=0, atol=0)
        assert torch.equal(layers[1]._from_table(x, ids, w), layers[0]._from_table(x, ids, w))
    for m in layers:
        stats = m.runtime.stats.snapshot()
        assert stats["cpu_experts"] > 0 and stats["misses"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_arm_between_graph_pieces_equals_its_eager_call(q8_gguf, tmp_path, monkeypatch,
                                                               gather_on_cpu, dtype):
    """Held on the wall check's cpu arm, a plan between graph pieces submits every routed pair
    from the host copies: the pool's result is the eager call's to the bit, the device's share
    (an empty slot table) is zero, and nothing is fetched or counted a hit."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    layers = [_hybrid(q8_gguf)[1][0] for _ in range(2)]
    for m in layers:
        check = m.policy.costs.check
        assert check is not None
        check.hold("cpu")
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x, ids, w, eager, planned, cpu_out = _eager_and_between_pieces(layers, g, dtype)
        assert planned is cpu_out and eager is not None
        torch.testing.assert_close(planned, eager, rtol=0, atol=0)
        assert not layers[1]._from_table(x, ids, w).any()
    for m in layers:
        stats = m.runtime.stats.snapshot()
        assert stats["cpu_experts"] == 8 and stats["hits"] == 0 and stats["bytes_fetched"] == 0


def test_a_plan_in_a_fetching_graph_fetches_every_miss_from_the_ids_alone(
        q8_gguf, tmp_path, monkeypatch, gather_on_cpu):
    """In a decode graph made for steps that fetch every miss, a hybrid layer's plan gets host
    copies of the routed ids only: it plans as the same layer held at all-fetch does (the
    same fetches, the same device result), gives the CPU nothing though its own split would,
    is collected at once, and its call counts in the wall check's wait."""
    from freetoken.moe.host_steps import HostCopies

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    layers = [_hybrid(q8_gguf)[1][0] for _ in range(2)]
    for m in layers:  # held at all-fetch, layer 0 would fetch for the next layer's calls
        m.lookahead = None
    layers[0].policy.costs.check.hold("fetch")
    check = layers[1].policy.costs.check
    check.hold("split")  # its own split gives the CPU a share
    layers[1].policy.fraction, layers[1].policy.max_fetch = 0.5, None
    g = torch.Generator().manual_seed(5)
    for call in range(6):
        x = torch.randn(1, layers[0].shape.hidden, generator=g)
        ids = torch.randperm(layers[0].shape.num_experts, generator=g)[:2].view(1, 2)
        w = torch.rand(1, 2, generator=g)
        assert layers[0]._plan(x, ids, w) is None and layers[0]._finish() is None
        H = x.shape[1]
        host = HostCopies(torch.empty(0, H), ids.clone(), torch.empty(0, 2),
                          torch.empty(0, H))
        assert not host.inputs
        nan = float("nan")
        assert layers[1]._plan_fetching(torch.full_like(x, nan), ids, torch.full_like(w, nan),
                                        host) is None
        assert not layers[1].policy.fetching and layers[1].calls.pending is None
        last = layers[1].calls.last  # its times kept for the split's model: no CPU share
        assert last is not None and last[:2] == (0, 0.0) and not layers[1].policy.probing
        assert check._calls == call + 1  # counted, in the wait
        assert torch.equal(layers[1]._from_table(x, ids, w), layers[0]._from_table(x, ids, w))
    a, b = (m.runtime.stats.snapshot() for m in layers)
    assert b["cpu_experts"] == 0 and b["misses"] == a["misses"] > 0
    assert b["bytes_fetched"] == a["bytes_fetched"]


def test_each_observation_sees_its_own_calls_probe(q8_gguf, tmp_path, monkeypatch,
                                                   gather_on_cpu):
    """The policy learns whether the call it observes was a probe (to back off while probes
    lose): a layer's calls must hand it the probe flag of that call, not of the next one."""
    from freetoken.moe.split import SplitPolicy

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    layer = _hybrid(q8_gguf)[1][0]
    policy = layer.policy = SplitPolicy(1.0, None, online=True)
    made, seen = [], []
    count, observe = policy.count, policy.observe

    def counting(misses: int) -> int:
        n = count(misses)
        made.append(policy.probing)
        return n

    def watching(*args, **kwargs) -> None:
        seen.append(policy.probing)
        observe(*args, **kwargs)

    monkeypatch.setattr(policy, "count", counting)
    monkeypatch.setattr(policy, "observe", watching)
    g = torch.Generator().manual_seed(2)
    for _ in range(40):
        x = torch.randn(1, layer.shape.hidden, generator=g)
        ids = torch.randperm(layer.shape.num_experts, generator=g)[:2].view(1, 2)
        layer._plan(x, ids, torch.rand(1, 2, generator=g))
        layer._finish()
    assert "cpu" in made and len(seen) >= len(made) - 1
    assert seen == made[:len(seen)]


def test_auto_plan_per_layer(caplog):
    from freetoken.moe.plan import plan_auto
    from freetoken.moe.profile import LayerKind

    q8 = LayerKind("gguf", 2816, 704, 8, (("down_type", "8"), ("gate_up_type", "8")))
    bf = LayerKind("bf16", 2816, 704, 8)
    kinds = {q8: list(range(1, 30)), bf: [30]}  # layer 0 dense
    recs = {q8: "hybrid", bf: None}
    with caplog.at_level("INFO"):
        plan = plan_auto(kinds, 31, layer_bytes=10, budget=35, recommend=recs.get)
    assert plan[:4] == ("resident",) * 4 and plan[4:30] == ("hybrid",) * 26
    assert plan[30] == "offload"
    assert "resident on 3 layers, hybrid on 26 layers, offload on 1 layer" in caplog.text
    assert "no bandwidth profile row for bf16:2816x704:top8" in caplog.text
    everything = plan_auto(kinds, 31, layer_bytes=10, budget=10**6, recommend=recs.get)
    assert set(everything) == {"resident"}
    assert plan_auto({q8: [0, 1]}, 2, 10, 0, lambda k: "offload") == ("offload", "offload")


@pytest.mark.cuda
def test_hybrid_on_cuda_close_to_resident(q8_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    resident = our_logits(load_ours(q8_gguf, torch.bfloat16, "cuda"), IDS, 4, "cuda")
    model = load_ours(q8_gguf, torch.bfloat16, "cuda", "hybrid", CacheSizing("size", 3))
    hybrid = our_logits(model, IDS, 4, "cuda")
    torch.testing.assert_close(hybrid, resident, atol=5e-2, rtol=5e-2)
    stats = offload_stats(model)
    assert stats is not None and stats["cpu_experts"] > 0 and stats["misses"] > 0


def test_spin_flag_out_of_range_is_a_one_line_error():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu",
                        "--moe-cpu-spin-us", "-5", "--prompt", "x"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "--moe-cpu-spin-us must be within 0..100000, got -5" in last, r.stderr


def test_a_cpu_probed_after_sitting_idle_is_timed_warm():
    """Twelve layers from all-fetch (where look-ahead leaves hybrid once the split fetches
    every miss): the CPU costs 1.0 a job plus 0.4 an expert against the link's 1.0 an expert,
    but a job right after a call without CPU work runs cold, 8.0 more (workers asleep, cold
    caches; on the H200 a probe measured 4-8x its warm time). Judged by those cold probes the
    CPU never gets its share back (24.5 against 33.1 tok/s measured); timing the probe's
    second, warm job, and letting it rescale costs fitted to cold jobs (3.0 an expert and
    5.0 a job here, as the H200 run's 198 and 457 us against 45-57 and 25 warm), the split
    settles where the CPU pays."""
    layers, link = 12, 1.0
    policies = shared_policies(layers, 1.0, probe_fraction=0.5)
    costs = policies[0].costs
    for k in [1, 1, 2, 3, 4, 5, 6, 7, 8] * 3:  # what cold jobs of 1..8 experts left in the fit
        costs.observe(k, 5.0 + 3.0 * k, 0, 0.0, 1.0, True, "")
    costs.observe(0, 0.0, 8, 8 * link, 0.0, True, "")
    assert costs.c_cpu == pytest.approx(3.0) and costs.l_cpu == pytest.approx(5.0)
    last: list[tuple[int, float, int, float, float] | None] = [None] * layers
    idle = True  # the previous call in the engine's order gave the CPU nothing
    late = []
    for step in range(300):
        total = 0.0
        for i, p in enumerate(policies):
            if last[i] is not None:
                p.observe(*last[i])
            n = p.n_fetch(8)
            t_cpu = (1.0 + 0.4 * (8 - n) + (8.0 if idle else 0.0)) if n < 8 else 0.0
            idle = n == 8
            last[i] = (8 - n, t_cpu, n, n * link, 0.1 if n < 8 else 0.0)
            total += max(t_cpu, n * link) + last[i][4]
        if step >= 200:
            late.append(total)
    offload = layers * 8 * link
    assert sum(late) / len(late) < 0.75 * offload
    assert all(p.fraction < 1.0 for p in policies)
