"""The cpu strategy's jobs served on a decode graph's flags (``cpu/graph_flags.py``): the
library serves each job once its go flag is set, in order, with the pool's own job bits for
the live rows, and sets its done flag; a flag that never comes lets the graph go (every done
flag set) and is raised; on a GPU, decode graphs whose jobs are served on flags give the
tokens of eager decode (``test_host_node.py``). Here another thread sets the go flags, as the
graph's stream writes do."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.graph_flags import FlagJobs, FlagJobsError, graph_jobs
from freetoken.cpu.host_node import HostNodeError, HostNodes
from tests.moe.test_host_node import SHAPE, _inputs, make_pool

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


@pytest.fixture(scope="module")
def pool() -> cx.CpuMoeExecutor:
    return make_pool()


def _jobs(pool: cx.CpuMoeExecutor, n: int,
          T: int) -> tuple[FlagJobs, list[tuple[torch.Tensor, ...]]]:
    """``n`` jobs on ``pool``'s layer, the first half in piece 0 and the rest in piece 1,
    their inputs filled from seeds."""
    flags = FlagJobs()
    bufs = []
    for i in range(n):
        x, ids, w = (t.clone() for t in _inputs(T, 10 + i))
        out = torch.full((T, SHAPE.hidden), float("nan"))
        job = flags.job(pool, SHAPE.layer, x, ids, w, out)
        assert flags.hold(job, 0 if i < n // 2 else 1) == i
        bufs.append((x, ids, w, out))
    return flags, bufs


def _gpu(flags: FlagJobs, jobs: range, seen: list[int]) -> threading.Thread:
    """A thread in the graph's place: each job's go flag set once the job before it is done
    (the stream's order), the done flags it saw appended to ``seen``."""
    go, done = flags.flags[0], flags.flags[1]

    def run() -> None:
        for i in jobs:
            go[i] = 1
            until = time.monotonic() + 10
            while int(done[i]) != 1 and time.monotonic() < until:
                time.sleep(1e-4)
            if int(done[i]) == 1:
                seen.append(i)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_jobs_are_served_in_order_on_their_flags_with_the_pools_bits(
        pool: cx.CpuMoeExecutor) -> None:
    T, rows = 3, 2
    flags, bufs = _jobs(pool, 4, T)
    flags.set_rows(rows)
    seen: list[int] = []
    gpu = _gpu(flags, range(4), seen)
    flags.serve(0)
    flags.serve(1)
    gpu.join()
    assert seen == [0, 1, 2, 3]
    for x, ids, w, out in bufs:
        want = pool.run(x[:rows], ids[:rows], w[:rows], SHAPE.layer)
        torch.testing.assert_close(out[:rows], want, rtol=0, atol=0)
        assert out[rows:].isnan().all()  # padded rows are not computed
    flags.check()
    flags.set_rows(rows)  # the next replay starts from zeroed flags
    assert int(flags.flags.abs().sum()) == 0


def test_a_flag_that_never_comes_lets_the_graph_go_and_is_raised(pool: cx.CpuMoeExecutor) -> None:
    flags, bufs = _jobs(pool, 4, 1)
    flags.timeout_ms = 50
    flags.set_rows(1)
    seen: list[int] = []
    gpu = _gpu(flags, range(2), seen)  # the graph stops before job 2 (piece 1's first)
    flags.serve(0)
    gpu.join()
    with pytest.raises(FlagJobsError, match=r"CPU job 2 \(of jobs 2..3\) in 50 ms"):
        flags.serve(1)
    assert flags.flags[1, :4].tolist() == [1, 1, 1, 1]  # job 2 and 3 are let go
    assert bufs[2][3].isnan().all() and bufs[3][3].isnan().all()
    flags.set_rows(1)
    flags.release()  # what the engine does when serving is interrupted
    assert flags.flags[1, :4].tolist() == [1, 1, 1, 1]


def test_a_refused_job_still_lets_its_graph_go(pool: cx.CpuMoeExecutor) -> None:
    flags, bufs = _jobs(pool, 2, 1)
    bufs[1][1][0, 0] = SHAPE.num_experts  # out of range: the pool refuses the job
    flags.set_rows(1)
    seen: list[int] = []
    gpu = _gpu(flags, range(2), seen)
    flags.serve(0)
    flags.serve(1)
    gpu.join()
    assert seen == [0, 1]
    with pytest.raises(HostNodeError, match="expert id out of range"):
        flags.check()


def test_a_pieces_jobs_and_steps_are_served_in_graph_order(pool: cx.CpuMoeExecutor) -> None:
    """Jobs 0, then a host step, then jobs 1 and 2 in one piece: job 0 is served before the
    step, jobs 1 and 2 (one library call) after it; a job is held right after it is made."""
    flags, _ = _jobs(pool, 0, 1)
    x, ids, w = _inputs(1, 1)
    made = [flags.job(pool, SHAPE.layer, x, ids, w, torch.zeros(1, SHAPE.hidden))]
    flags.hold(made[0], 0)

    class Step:
        def serve(self, n: int) -> None:
            self.saw = (n, flags.flags[1, :3].tolist())
            flags.set_done(self.k)

    step = Step()
    step.k = flags.add_step(step, 0)
    for _ in range(2):
        made.append(flags.job(pool, SHAPE.layer, x, ids, w, torch.zeros(1, SHAPE.hidden)))
        flags.hold(made[-1], 0)
    assert flags.items[0] == [[0, 1], step, [1, 2]]
    with pytest.raises(ValueError, match="right after it is made"):
        flags.hold(made[0], 0)
    flags.set_rows(1)
    seen: list[int] = []
    gpu = _gpu(flags, range(3), seen)
    flags.serve(0)
    gpu.join()
    assert step.saw == (1, [1, 0, 0]) and seen == [0, 1, 2]
    assert int(flags.flags[3, step.k]) == 1
    flags.release()  # every done flag, the steps' too
    assert flags.flags[1, :3].tolist() == [1, 1, 1]


def test_flags_are_asked_for_by_name(monkeypatch) -> None:
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "flag")
    got = graph_jobs()
    if torch.cuda.is_available():
        assert got is FlagJobs
    else:
        assert isinstance(got, str) and "CUDA driver" in got
    monkeypatch.setenv("FREETOKEN_CPU_HOST_NODE", "off")
    assert isinstance(graph_jobs(), str)
    assert issubclass(FlagJobs, HostNodes)


def test_a_job_sets_its_signal_once_its_result_is_whole(pool: cx.CpuMoeExecutor) -> None:
    """A hybrid layer's CPU share inside a decode graph: the pool sets the flag the graph waits
    on as the job ends, with no thread of ours in between. What a reader sees at the flag is
    the whole result (the pool's own run of the same job, bit for bit)."""
    T = 3
    x, ids, w = (t.contiguous() for t in _inputs(T, 40))
    ids[1, 0] = -1  # a pair that is not the CPU's
    want = pool.run(x, ids, w, SHAPE.layer)
    for _ in range(20):
        out = torch.full((T, SHAPE.hidden), float("nan"))
        flag = torch.zeros(1, dtype=torch.int32)
        seen: list[torch.Tensor] = []

        def graph(flag: torch.Tensor = flag, out: torch.Tensor = out,
                  seen: list[torch.Tensor] = seen) -> None:
            until = time.monotonic() + 10
            while int(flag[0]) != 1 and time.monotonic() < until:
                pass
            seen.append(out.clone())

        reader = threading.Thread(target=graph)
        reader.start()
        job = pool.prepare(x, ids, w, SHAPE.layer, out)
        future = pool.submit_prepared(job, flag.data_ptr())
        reader.join()
        future.wait()
        assert int(flag[0]) == 1
        torch.testing.assert_close(seen[0], want, rtol=0, atol=0)
    plain = pool.submit_prepared(pool.prepare(x, ids, w, SHAPE.layer, torch.empty(T, SHAPE.hidden)))
    torch.testing.assert_close(plain.wait(), want, rtol=0, atol=0)  # no signal: none set
