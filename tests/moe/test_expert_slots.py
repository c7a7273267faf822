"""The expert cache's slot decisions in the library (NativeSlotPool) against their Python twin
(SlotPool) on random decode traces: the same hits and misses, the same fetched experts in the
same victim slots, the same CPU share, the same LRU order and owners, call after call."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.moe.native_slot_pool import NativeSlotPool
from freetoken.moe.slot_pool import SlotPool

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


def _pools(slots: int, layers: int, experts: int) -> tuple[SlotPool, NativeSlotPool]:
    twin, pool = SlotPool(8, slots, torch.device("cpu")), NativeSlotPool(8, slots,
                                                                        torch.device("cpu"))
    for p in (twin, pool):
        for layer in range(layers):
            p.add_layer(layer, experts)
    return twin, pool


def _same_state(twin: SlotPool, pool: NativeSlotPool, layers: int) -> None:
    assert pool.state() == twin.state()
    for layer in range(layers):
        assert pool.tables[layer].tolist() == list(twin.tables[layer])


@pytest.mark.parametrize("seed", range(6))
def test_route_and_split_decide_as_the_twin(seed: int) -> None:
    rng = random.Random(seed)
    layers, experts, top_k = 3, rng.choice([16, 64, 128]), rng.choice([2, 4, 8])
    slots = rng.choice([top_k, 2 * top_k + 1, 40, 3 * experts])
    twin, pool = _pools(slots, layers, experts)
    hot = [rng.sample(range(experts), top_k) for _ in range(layers)]
    for call in range(300):
        layer, tokens = rng.randrange(layers), rng.choice([1, 1, 1, 2, 3])
        flat = torch.tensor([rng.choice(hot[layer]) if rng.random() < 0.5
                             else rng.randrange(experts) for _ in range(tokens * top_k)])
        a, b = twin.route(layer, flat), pool.route(layer, flat)
        for f in ("needed", "uses", "slot"):
            assert getattr(b, f).tolist() == getattr(a, f).tolist(), (call, f)
        assert b.hits() == a.hits() and b.missed() == a.missed() and b.misses == a.misses
        if a.needed.size > slots:  # more experts than slots: the call would stream
            continue
        n_fetch = rng.randint(-1, a.misses + 1)
        cpu_a, cpu_b = torch.zeros_like(flat), torch.full_like(flat, 99)
        sa = twin.split(layer, flat, a, n_fetch, cpu_a)
        sb = pool.split(layer, flat, b, n_fetch, cpu_b)
        assert sb.fetched.tolist() == sa.fetched.tolist() and sb.slots.tolist() == \
            sa.slots.tolist() and sb.cpu == sa.cpu
        assert cpu_b.tolist() == cpu_a.tolist()
        # the slow twin's own rule, restated: the most used misses are fetched
        missed = a.missed()
        uses = dict(zip(a.needed.tolist(), a.uses.tolist(), strict=True))
        n = max(0, min(n_fetch, len(missed)))
        assert sorted(sa.fetched.tolist()) == sorted(
            sorted(missed, key=lambda e: (-uses[e], e))[:n])
        assert sum(1 for e in cpu_a.tolist() if e >= 0) == sum(
            uses[e] for e in set(missed) - set(sa.fetched.tolist()))
        if rng.random() < 0.3:  # look-ahead: the picks of another layer's router
            other = rng.randrange(layers)
            picks = torch.tensor([rng.choice(hot[other]) if rng.random() < 0.5
                                  else rng.randrange(experts) for _ in range(tokens * top_k)])
            keep = np.concatenate((a.slot, sa.slots))  # a miss's -1 is ignored
            cap = rng.randint(0, top_k)
            pa = twin.prefetch(other, picks, keep, lambda m, cap=cap: min(m, cap))
            pb = pool.prefetch(other, picks, keep, lambda m, cap=cap: min(m, cap))
            for f in ("predicted", "fetched", "slots"):
                assert getattr(pb, f).tolist() == getattr(pa, f).tolist(), (call, f)
            # the rule, restated: most picked first (ties: lower id); the first misses fetched
            counts = np.bincount(picks.numpy(), minlength=experts)
            assert pa.predicted.tolist() == [int(e) for e in np.argsort(-counts, kind="stable")
                                             if counts[e]]
            assert not set(pa.slots.tolist()) & set(keep.tolist()) - {-1}
            assert pa.fetched.size <= cap
        _same_state(twin, pool, layers)


def test_no_slot_left_is_refused_as_the_twin_refuses() -> None:
    twin, pool = _pools(3, 1, 8)
    for p in (twin, pool):
        p.admit(0, [0, 1, 2], set())
        with pytest.raises(RuntimeError, match="none left to evict"):
            p.admit(0, [6], {0, 1, 2})
    _same_state(twin, pool, 1)
    flat = torch.tensor([3, 4, 5, 6])
    for p in (twin, pool):
        with pytest.raises(RuntimeError, match="none left to evict"):
            p.split(0, flat, p.route(0, flat), 4)


def test_an_expert_the_layer_lacks_is_named_and_changes_nothing() -> None:
    twin, pool = _pools(4, 1, 8)
    with pytest.raises(ValueError, match="expert it lacks"):
        pool.route(0, torch.tensor([1, 8]))
    with pytest.raises(ValueError, match="no experts"):
        pool.admit(0, [2, 8], set())
    with pytest.raises(ValueError, match="no experts"):
        pool.lookup(0, [-1])
    with pytest.raises(ValueError, match="no experts"):
        pool.prefetch(0, torch.tensor([3, 8]), np.array([], dtype=np.int64), lambda m: m)
    flat = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="expert it lacks"):
        pool.split(0, torch.tensor([1, 9]), pool.route(0, flat), 2)
    twin.route(0, flat)  # the same route on the twin: the states agree again
    _same_state(twin, pool, 1)
