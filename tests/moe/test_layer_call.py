"""The library's plan of a layer call between graph pieces (``csrc/layer_call.cpp``) against
its slow twin, the Python plan: the same fetch counts as the split policy, and on random
traces the same slot decisions, CPU pairs, results and stats."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.cpu import abi
from freetoken.cpu.library import native
from freetoken.moe.host_steps import HostCopies
from freetoken.moe.hybrid import HybridExperts
from freetoken.moe.layer_call import STREAMS, LayerCall
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.split import SplitCosts, SplitPolicy
from freetoken.moe.wall_check import WallCheck
from tests.models.helpers import load_ours


def test_the_librarys_fetch_count_is_the_policys():
    """:meth:`SplitPolicy.rule` in the library gives :meth:`SplitPolicy.count`'s number and
    probe for every share, cap, probe due and held arm, Python's rounding (ties to even)
    included."""
    lib = native()
    rng = random.Random(0)
    probing = ctypes.c_int()
    seen = set()
    for _ in range(3000):
        costs = SplitCosts()
        due = {"cpu": rng.random() < 0.5, "pcie": rng.random() < 0.5}
        costs.probe_due = due.__getitem__  # type: ignore[method-assign]
        policy = SplitPolicy(rng.choice([None, 0.0, 0.25, 0.5, 0.3, 1.0]),
                             rng.choice([None, 0, 1, 2, 5]), rng.random() < 0.7,
                             probe_fraction=rng.choice([0.2, 0.5, 0.75, 1.0]), costs=costs)
        if rng.random() < 0.3:
            costs.check = WallCheck("test")
            costs.check.use_profile(rng.choice([0.25, 0.5, 0.7]))
            costs.check.hold(rng.choice(["fetch", "cpu", "profile", "split"]))
        m = rng.randint(0, 12)
        rule = abi.FetchRule()
        policy.rule(rule)
        n = lib.ft_fetch_count(ctypes.byref(rule), m, ctypes.byref(probing))
        assert (n, abi.PROBINGS[probing.value]) == (policy.count(m), policy.probing), (
            policy, due, m)
        seen.add(policy.probing)
    assert seen == {"", "cpu", "pcie"}


def test_the_librarys_look_ahead_count_is_the_rules(tiny_qwen3_moe):
    """A hybrid layer's :meth:`prefetch_rule` (its split's share or the look-ahead share,
    whichever fetches more, within its cap; every miss while all-fetch is held, none before a
    share or while the cpu arm is) counts in the library as in Python, ties to even
    included."""
    lib = native()
    m = next(m for m in load_ours(tiny_qwen3_moe, strategy="hybrid",
                                  cache=CacheSizing("size", 4)).modules()
             if isinstance(m, HybridExperts))
    rng = random.Random(1)
    counts = set()
    for _ in range(2000):
        m.policy = SplitPolicy(rng.choice([None, 0.0, 0.125, 0.25, 0.5, 0.3, 1.0]),
                               rng.choice([None, 0, 1, 3]), online=False, costs=SplitCosts())
        if rng.random() < 0.3:
            m.policy.costs.check = WallCheck("test")
            m.policy.costs.check.use_profile(rng.choice([0.25, 0.5]))
            m.policy.costs.check.hold(rng.choice(["fetch", "cpu", "profile"]))
        m.prefetch = rng.choice([0.0, 0.125, 0.4, 0.5])
        rule, into = m.prefetch_rule(), abi.AheadRule()
        rule.write(into, 8)
        misses = rng.randint(0, 12)
        assert lib.ft_ahead_count(ctypes.byref(into), misses) == rule.count(misses), (
            rule, misses)
        counts.add(rule.count(misses))
    assert len(counts) > 5, counts


@pytest.fixture(scope="module")
def q8_gguf(tiny_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("layer_call") / "q8.gguf"
    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), out,
                           lambda n, s: "q8_0" if ".experts." in n else "f32")


def _twins(path, strategy: str, lookahead: str, device: str,
           monkeypatch) -> list[list[OffloadExperts]]:
    """The MoE layers of two models, planned by the library and in Python."""
    twins = []
    for how in ("native", "python"):
        monkeypatch.setenv("FREETOKEN_LAYER_CALL", how)
        model = load_ours(path, device=device, strategy=strategy,
                          cache=CacheSizing("size", 3), lookahead=lookahead)
        layers = [m for m in model.modules() if isinstance(m, OffloadExperts)]
        assert len(layers) > 1
        assert all((m.layer_calls is not None) == (how == "native") for m in layers)
        twins.append(layers)
    return twins


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("lookahead", ["off", "on"])
@pytest.mark.parametrize("strategy", ["hybrid", "offload"])
def test_the_library_plans_a_call_as_the_python_plan_does(q8_gguf, tmp_path, monkeypatch,
                                                         gather_on_cpu, strategy, lookahead,
                                                         device):
    """Random calls of 1 and 2 tokens (evictions, CPU shares, calls that stream; with
    look-ahead, the next layer's picks ranked, fetched and scored, by the library in its plan
    and by Python after it; half of the library's calls set up by ``_prepare`` before their
    inputs come, as a graph's host step does) through both plans, layer after layer, on
    host copies as a graph step makes them (on CUDA pinned, the copies and the table on the
    driver's streams): every call's result (the device's share through the table, the CPU's
    in the host copies, or the streamed result), the cache's LRU order and owners, the tables
    and the stats are the same."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    twins = _twins(q8_gguf, strategy, lookahead, device, monkeypatch)
    planned = []  # the library's answers
    ahead = []  # whether the library made the call's look-ahead, and how many it predicted
    run = LayerCall.run

    def run_and_see(self: LayerCall) -> int:
        planned.append(run(self))
        ahead.append((self.ahead is not None, self.c.ahead.n_predicted))
        return planned[-1]

    monkeypatch.setattr(LayerCall, "run", run_and_see)
    g, rng = torch.Generator().manual_seed(3), random.Random(3)
    s = twins[0][0].shape
    copies: dict[tuple[int, int, int], HostCopies] = {}  # fixed buffers, as a graph's
    kinds = set()
    calls = 0

    def buffer(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype, pin_memory=device == "cuda")

    for _ in range(40):
        T = rng.choice([1, 1, 2])
        fraction, cap = rng.choice([None, 0.0, 0.5, 1.0]), rng.choice([None, 1])
        for j in range(len(twins[0])):
            x = torch.randn(T, s.hidden, generator=g)
            ids = torch.stack([torch.randperm(s.num_experts, generator=g)[:s.top_k]
                               for _ in range(T)])
            w = torch.rand(T, s.top_k, generator=g)
            hx, hids, hw = x, ids, w
            x, ids, w = x.to(device), ids.to(device), w.to(device)
            prepare = rng.random() < 0.5  # the library's call set up before its inputs came
            outs = []
            for i, layers in enumerate(twins):
                m, la = layers[j], layers[j].lookahead
                picks = None if la is None else la.route(x).cpu()
                host = copies.setdefault((T, i, j), HostCopies(
                    buffer(hx), buffer(hids), buffer(hw), buffer(hx),
                    None if picks is None else buffer(picks)))
                host.x.copy_(hx), host.ids.copy_(hids), host.w.copy_(hw)
                if picks is not None:
                    host.predicted.copy_(picks)
                if isinstance(m, HybridExperts):
                    m.policy = SplitPolicy(fraction, cap, online=False)
                if prepare and i == 0:
                    m._prepare(host)
                early = m._plan(x, ids, w, host)
                late = m._finish()
                if early is not None:  # streamed
                    outs.append(("streamed", early))
                else:
                    outs.append(("planned", m._from_table(x, ids, w),
                                 None if late is None else late.clone()))
            calls += 1
            kinds.add(outs[0][0] if outs[0][0] == "streamed" or outs[0][2] is None else "cpu")
            assert outs[0][0] == outs[1][0]
            for a, b in zip(outs[0][1:], outs[1][1:], strict=True):
                assert (a is None) == (b is None)
                if a is not None:
                    assert torch.equal(a, b)
            pools = [layers[j].runtime.cache.pool(s.layer) for layers in twins]
            assert pools[0].state() == pools[1].state()
            for layer in pools[0].tables:
                assert list(pools[0].tables[layer]) == list(pools[1].tables[layer])
                assert torch.equal(pools[0].device_tables[layer], pools[1].device_tables[layer])
    stats = [layers[0].runtime.stats.snapshot() for layers in twins]
    for key in ("calls", "hits", "misses", "bytes_fetched", "cpu_experts", "streamed",
                "prefetched", "lookahead_predicted", "lookahead_used", "lookahead_needed"):
        assert stats[0].get(key) == stats[1].get(key), key
    assert sorted(set(planned)) == [0, STREAMS] and len(planned) == calls
    # with look-ahead the library made it in every call whose next layer is offloaded
    assert any(native for native, _ in ahead) == (lookahead == "on")
    assert any(n > 0 for _, n in ahead) == (lookahead == "on")
    assert (stats[0]["prefetched"] > 0) == (lookahead == "on"), stats[0]["prefetched"]
    assert kinds >= ({"planned", "cpu", "streamed"} if strategy == "hybrid"
                     else {"planned", "streamed"}), kinds


@pytest.mark.parametrize("strategy", ["hybrid", "offload"])
def test_an_expert_id_out_of_range_is_refused_as_the_python_plan_refuses_it(
        q8_gguf, tmp_path, monkeypatch, strategy):
    """Routed ids the layer does not have: both plans raise the same error, and the library's
    leaves the cache as it was."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    twins = _twins(q8_gguf, strategy, "off", "cpu", monkeypatch)
    s = twins[0][0].shape
    errors = []
    for layers in twins:
        m = layers[0]
        bad = torch.tensor([[0, s.num_experts]])
        host = HostCopies(torch.zeros(1, s.hidden), bad, torch.zeros(1, s.top_k),
                          torch.zeros(1, s.hidden))
        pool = m.runtime.cache.pool(s.layer)
        before = pool.state()
        with pytest.raises(ValueError, match="routed to an expert it lacks") as e:
            m._plan(host.x, bad, host.w, host)
        assert pool.state() == before
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_a_call_that_fails_after_its_cpu_job_went_out_gives_the_pools_slot_back(
        q8_gguf, tmp_path, monkeypatch, gather_on_cpu):
    """Look-ahead's picks name an expert the next layer lacks: the library fails the call
    after it submitted the CPU's share. The error names the picks, and the job is waited for,
    so the pool has as many free job slots as before (a job never waited for keeps its slot,
    and the pool has 16)."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    monkeypatch.setenv("FREETOKEN_LAYER_CALL", "native")
    model = load_ours(q8_gguf, device="cpu", strategy="hybrid", cache=CacheSizing("size", 3),
                      lookahead="on")
    m = next(m for m in model.modules() if isinstance(m, HybridExperts) and m.lookahead)
    s, executor = m.shape, m.executor
    assert executor is not None and m.lookahead is not None
    seen: list[LayerCall] = []
    run = LayerCall.run

    def run_and_keep(self: LayerCall) -> int:
        seen.append(self)
        return run(self)

    monkeypatch.setattr(LayerCall, "run", run_and_keep)
    g = torch.Generator().manual_seed(5)
    free = executor.free_jobs()
    for _ in range(executor.free_jobs() + 2):  # more failures than the pool has slots
        x = torch.randn(1, s.hidden, generator=g)
        ids = torch.randperm(s.num_experts, generator=g)[:s.top_k].reshape(1, -1)
        w = torch.rand(1, s.top_k, generator=g)
        picks = m.lookahead.route(x).clone()
        picks.view(-1)[0] = s.num_experts
        host = HostCopies(x.clone(), ids.clone(), w.clone(), torch.zeros_like(x), picks)
        m.policy = SplitPolicy(0.0, None, online=False)  # every miss on the CPU
        m.lookahead.target.policy = SplitPolicy(1.0, None, online=False)  # picks all fetched
        with pytest.raises(ValueError, match="has no experts"):
            m._plan(x, ids, w, host)
        assert seen[-1].c.ticket >= 0 and seen[-1].c.n_cpu > 0, "the CPU's job did not go out"
        assert executor.free_jobs() == free
