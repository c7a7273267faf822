"""The cpu strategy's jobs as host nodes of the decode graph (``cpu/host_node.py``): the
library's host function gives the pool's own job bits for the live rows only and counts a
refused job; on a GPU, decode graphs that hold the jobs give the tokens of eager decode and of
the default that breaks the graph at each layer (host nodes are FREETOKEN_CPU_HOST_NODE=on)."""

from __future__ import annotations

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.graph_flags import FlagJobs, graph_jobs
from freetoken.cpu.host_node import HostNodeError, HostNodes, host_nodes
from freetoken.errors import ConfigError
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.strategy import ExpertShape, LayerPlan, Shared
from freetoken.quant import get_format

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

SHAPE = ExpertShape(layer=3, num_experts=8, hidden=64, intermediate=96, top_k=2,
                    activation="silu")


@pytest.fixture(scope="module")
def pool() -> cx.CpuMoeExecutor:
    return make_pool()


def make_pool() -> cx.CpuMoeExecutor:
    """A one-thread pool with SHAPE's layer of random q8_0 experts."""
    pool = cx.CpuMoeExecutor(threads=1)
    experts = CpuExperts(SHAPE)
    g = torch.Generator().manual_seed(0)
    E, H, I_ = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate
    q8 = get_format("q8_0")
    for name, shape in (("gate_proj", (E, I_, H)), ("up_proj", (E, I_, H)),
                        ("down_proj", (E, H, I_))):
        experts.load_expert_tensor(name, q8.quantize(torch.randn(shape, generator=g) / 8))
    experts.attach(LayerPlan("cpu"), Shared(pool=pool))
    return pool


def _inputs(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, SHAPE.hidden, generator=g)
    ids = torch.stack([torch.randperm(SHAPE.num_experts, generator=g)[:2] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, 2, generator=g), -1)


def test_a_thread_running_the_jobs_is_pinned_to_the_steps_core_first(pool) -> None:
    """The driver's host thread runs a graph's jobs pinned to the step's core (the engine
    thread's); without a core the caller stays as it was (the CPU twin's calls)."""
    import os
    import threading

    x, ids, w = _inputs(1, 1)
    nodes = HostNodes()
    job = nodes.job(pool, SHAPE.layer, x, ids, w, torch.zeros(1, SHAPE.hidden))
    nodes.set_rows(1)
    core = max(os.sched_getaffinity(0))
    masks = {}

    def runs(name: str, pin: int) -> None:
        nodes.step.core = pin
        nodes.run(job)
        masks[name] = os.sched_getaffinity(0)  # this thread's

    for name, pin in (("unpinned", -1), ("pinned", core)):
        t = threading.Thread(target=runs, args=(name, pin))
        t.start()
        t.join()
    assert masks == {"unpinned": os.sched_getaffinity(0), "pinned": {core}}
    assert nodes.step.failures == 0


def test_the_host_function_gives_the_pools_job_on_the_live_rows(pool) -> None:
    T = 4
    x, ids, w = (t.clone() for t in _inputs(T, 1))
    out = torch.full((T, SHAPE.hidden), float("nan"))
    nodes = HostNodes()
    job = nodes.job(pool, SHAPE.layer, x, ids, w, out)
    for rows, seed in ((T, 1), (2, 2), (1, 3)):  # buffers refilled between runs, as a graph does
        fresh = _inputs(T, seed)
        for buf, value in zip((x, ids, w), fresh, strict=True):
            buf.copy_(value)
        out.fill_(float("nan"))
        nodes.set_rows(rows)
        nodes.run(job)
        want = pool.run(*(t[:rows] for t in fresh), SHAPE.layer)
        torch.testing.assert_close(out[:rows], want, rtol=0, atol=0)
        assert out[rows:].isnan().all()  # padded rows are not computed
    nodes.check()


def test_a_refused_job_is_raised_after_the_replay(pool) -> None:
    x, ids, w = _inputs(2, 4)
    ids[1, 0] = SHAPE.num_experts  # out of range: the pool refuses the job
    nodes = HostNodes()
    job = nodes.job(pool, SHAPE.layer, x, ids, w, torch.zeros(2, SHAPE.hidden))
    nodes.set_rows(2)
    nodes.run(job)
    with pytest.raises(HostNodeError, match="expert id out of range"):
        nodes.check()
    nodes.check()  # counted once


def test_host_nodes_are_asked_for_by_name(monkeypatch) -> None:
    monkeypatch.delenv("FREETOKEN_CPU_HOST_NODE", raising=False)
    assert "FREETOKEN_CPU_HOST_NODE=on" in host_nodes()
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "yes")
    with pytest.raises(ConfigError,
                       match="FREETOKEN_CPU_HOST_NODE='yes' is not one of flag, off, on"):
        host_nodes()


@pytest.mark.cuda
def test_graphs_with_host_nodes_decode_the_eager_tokens(tiny_qwen3_moe, monkeypatch) -> None:
    """cpu on a GPU: eager, graphs holding the jobs as host nodes or served on flags, and
    graphs broken at each layer's experts (the twin) give the same tokens, alone and
    batched."""
    from freetoken.engine.sample import SamplingParams
    from freetoken.engine.scheduler import Scheduler, Sequence
    from tests.engine.test_scheduler import _drain, _prompts, _runner

    def tokens(graphs: int) -> dict[str, list[int]]:
        runner = _runner(tiny_qwen3_moe, device="cuda", graphs=graphs, strategy="cpu")
        s = Scheduler(runner, max_running=4, prefix_cache=False)
        for i, prompt in enumerate(_prompts(4)):
            s.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
        return {rid: [e.token for e in ev] for rid, ev in _drain(s).items()}

    eager = tokens(0)
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "on")
    assert host_nodes() is None
    assert tokens(8) == eager
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "flag")  # served on flags (graph_flags.py)
    assert graph_jobs() is FlagJobs
    assert tokens(8) == eager
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "off")
    assert tokens(8) == eager
