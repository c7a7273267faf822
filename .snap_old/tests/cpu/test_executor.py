"""The CPU MoE executor around the kernels: ISA cap, core plan, async submit/wait, the pool under
stress, the startup line, and the error when the library is missing."""

from __future__ import annotations

import ctypes
import logging
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from freetoken.config import MOE_CPU_SPIN_US
from freetoken.cpu import executor as cx
from tests.cpu.test_kernels import E, inputs, make_bank, reference, stacks

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


def test_isa_cap_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CPU_ISA", "avx2")
    ex = cx.CpuMoeExecutor(threads=1)
    want = "avx2" if cx.ISAS.index(cx.best_isa()) >= cx.ISAS.index("avx2") else cx.best_isa()
    assert ex.isa == want
    info = ex.add_layer(0, *stacks(make_bank("q8_0", 96, 160)))
    assert all(cx.ISAS.index(isa) <= cx.ISAS.index(want) for isa, _ in info.kernels)
    monkeypatch.setenv("FREETOKEN_CPU_ISA", "scalar")
    info = cx.CpuMoeExecutor(threads=1).add_layer(0, *stacks(make_bank("bf16", 80, 40)))
    assert info.kernels == (("scalar", "f32"),) * 3


def test_bad_isa_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREETOKEN_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match=r"FREETOKEN_CPU_ISA='avx1024' \(choose from scalar"):
        cx.CpuMoeExecutor(threads=1)


@pytest.mark.parametrize(
    ("usable", "threads", "want"),
    [([0, 1], None, [1]), ([3], None, [3]), ([0, 1, 2, 3], None, [1, 2, 3]),
     ([0, 1, 2, 3], 2, [1, 2]), ([4, 5], 3, [5, 4, 5])],
)
def test_core_plan_leaves_the_first_core_to_the_main_thread(
    usable: list[int], threads: int | None, want: list[int]
) -> None:
    assert cx.plan_cores(usable, threads) == want


def test_core_plan_rejects_zero_threads() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        cx.plan_cores([0, 1], 0)


def test_startup_line(caplog: pytest.LogCaptureFixture) -> None:
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(3, *stacks(make_bank("q8_0", 96, 160)))
    with caplog.at_level(logging.INFO, logger="freetoken.cpu.executor"):
        ex.run(*inputs("q8_0", 2), layer=3)
        ex.run(*inputs("q8_0", 2), layer=3)
    lines = [r.getMessage() for r in caplog.records if "ready" in r.getMessage()]
    assert len(lines) == 1
    core = ex.cores[0]
    assert lines[0] == (f"CPU MoE executor ready: threads=1 (core {core}) isa={ex.isa} "
                        "fmt=q8_0 H=96 I=160 experts=8 layers=1 top_k=4")


def test_torch_threads_leave_the_pool_alone() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(len(cx.usable_cores()))
        ex = cx.CpuMoeExecutor()
        assert torch.get_num_threads() <= max(1, len(cx.usable_cores()) - len(set(ex.cores)))
        ex.close()  # a later engine in this process starts from torch's own count again
        assert torch.get_num_threads() == len(cx.usable_cores())
    finally:
        torch.set_num_threads(before)


def _slow_job():
    """A one-worker pool and a slow job for it (about 0.1 s on a fast core): the scalar
    kernels, every token on every expert."""
    bank = make_bank("bf16", 512, 512)
    ex = cx.CpuMoeExecutor(threads=1, isa="scalar")
    ex.add_layer(0, *stacks(bank))
    return bank, ex, torch.randn(32, 512), torch.arange(E).repeat(32, 1), torch.rand(32, E)


def test_submit_returns_before_the_work_is_done_and_wait_releases_the_gil() -> None:
    bank, ex, x, ids, w = _slow_job()
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t0 = time.perf_counter()
    fut = ex.submit(x, ids, w, 0)
    submitted = time.perf_counter() - t0
    counter = threading.Thread(target=count)
    counter.start()
    out = fut.wait()
    total = time.perf_counter() - t0
    stop.set()
    counter.join()
    assert submitted < total / 4, (submitted, total)
    assert ticks > 0
    assert fut.weight_bytes == 3 * E * 512 * 512 * 2
    err = (out.double() - reference(bank, x, ids, w)).abs().max()
    assert float(err) < 1e-4


def test_too_many_unwaited_jobs_is_an_error() -> None:
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(make_bank("q8_0", 96, 160)))
    futs = [ex.submit(*inputs("q8_0", 1), layer=0) for _ in range(cx.MAX_IN_FLIGHT)]
    with pytest.raises(RuntimeError, match="in flight"):
        ex.submit(*inputs("q8_0", 1), layer=0)
    with pytest.raises(RuntimeError, match="in flight"):
        ex.run(*inputs("q8_0", 1), layer=0)  # it would wait for a slot that never frees
    for f in futs:
        f.wait()
    ex.run(*inputs("q8_0", 1), layer=0)


def test_run_in_one_call_equals_submit_and_wait() -> None:
    from freetoken.quant import get_format

    ex = cx.CpuMoeExecutor(threads=2)
    bank = make_bank("q8_0", 96, 160)
    ex.add_layer(0, *stacks(bank))
    x, ids, w = inputs("q8_0", 3)
    fut = ex.submit(x, ids, w, layer=0)
    assert torch.equal(ex.run(x, ids, w, layer=0), fut.wait())
    ns = ctypes.c_int64(0)
    out, nbytes = ex.run_measured(x, ids, w, 0, ns)
    assert torch.equal(out, fut.wait()) and nbytes == fut.weight_bytes > 0 and ns.value > 0
    with pytest.raises(ValueError, match="expert ids must be <"):
        ex.run(x, torch.full_like(ids, E), w, layer=0)
    weight = torch.randn(40, 96)
    lid = ex.add_linear(cx.ExpertStack.from_quant(get_format("q8_0").quantize(weight)))
    xs = torch.randn(2, 96)
    assert torch.equal(ex.run_linear(xs, lid), ex.submit_linear(xs, lid).wait())
    with pytest.raises(ValueError, match=r"dense 40x96: input \(2, 95\)"):
        ex.run_linear(xs[:, :95], lid)
    ex.run(x, ids, w, layer=0)  # the failed calls gave their slots back


def test_a_dropped_future_is_waited_for() -> None:
    """Futures dropped without wait() (more of them than jobs may be in flight): each is
    waited for when it goes, so the workers never write into freed memory and its slot comes
    back. Run in a child process: the failure this guards against is a crash."""
    script = """
import torch
from freetoken.cpu import executor as cx
from freetoken.quant import get_format
ex = cx.CpuMoeExecutor(threads=1)
def stack(r, c):
    return cx.ExpertStack.from_quant(
        [get_format("bf16").quantize(torch.randn(r, c) * 0.02) for _ in range(4)])
ex.add_layer(0, stack(256, 512), stack(256, 512), stack(512, 256), activation="silu")
x, ids, w = torch.randn(2, 512), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
for _ in range(5 * cx.MAX_IN_FLIGHT):
    ex.submit(torch.randn(2, 512), ids, w, 0)  # dropped at once
want = ex.submit(x, ids, w, 0).wait().clone()
for _ in range(3):
    assert torch.equal(ex.submit(x, ids, w, 0).wait(), want)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("spin_us", [0, MOE_CPU_SPIN_US])
def test_two_threads_submitting_for_five_seconds_lose_nothing(spin_us: int) -> None:
    """Results are deterministic, so every one is compared bit for bit with its first run."""
    seconds = 2.5  # per spin setting: 5 s in all
    ex = cx.CpuMoeExecutor(threads=2, spin_us=spin_us)
    ex.add_layer(0, *stacks(make_bank("q8_0", 96, 160)))
    ex.add_layer(1, *stacks(make_bank("bf16", 80, 40)))
    rng = random.Random(0)
    cases = []
    for i in range(12):
        layer = i % 2
        x, ids, w = inputs("q8_0" if layer == 0 else "bf16", rng.randint(1, 6), seed=i)
        ids[0, 0] = -1 if i % 3 == 0 else ids[0, 0]
        cases.append((layer, x, ids, w, ex.run(x, ids, w, layer)))
    done = [0, 0]
    errors: list[str] = []

    def hammer(me: int) -> None:
        r = random.Random(me)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end and not errors:
            batch = [r.choice(cases) for _ in range(r.randint(1, 3))]  # a few in flight at once
            futs = [ex.submit(x, ids, w, layer) for layer, x, ids, w, _ in batch]
            for fut, (layer, *_, want) in zip(futs, batch, strict=True):
                if not torch.equal(fut.wait(), want):
                    errors.append(f"thread {me}: wrong result for layer {layer}")
                done[me] += 1

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert min(done) > 50, done


def test_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from freetoken.cpu import library

    monkeypatch.setattr(library, "_library_path", lambda: tmp_path / cx.LIBRARY)
    cx.native.cache_clear()
    try:
        with pytest.raises(cx.NativeUnavailable, match=r"was not built.*pip install -e \."):
            cx.native()
        assert "was not built" in (cx.available() or "")
    finally:
        cx.native.cache_clear()


def test_worker_states_say_what_each_worker_is_doing() -> None:
    """A slow job seen from outside while it runs (a worker 'running a job'), then every worker
    waiting, asleep with no spin, having run each job once."""
    bank = make_bank("bf16", 512, 512)
    ex = cx.CpuMoeExecutor(threads=1, isa="scalar", spin_us=0)
    ex.add_layer(0, *stacks(bank))
    x, ids, w = torch.randn(16, 512), torch.arange(E).repeat(16, 1), torch.rand(16, E)
    time.sleep(0.05)  # the worker's start
    assert [s["state"] for s in ex.worker_states()] == ["waiting (asleep)"]
    fut = ex.submit(x, ids, w, 0)
    seen = set()
    deadline = time.monotonic() + 5
    while "running a job" not in seen and time.monotonic() < deadline:
        seen |= {s["state"] for s in ex.worker_states()}
    fut.wait()
    ex.run(x[:1], ids[:1], w[:1], 0)
    assert "running a job" in seen
    time.sleep(0.05)
    states = ex.worker_states()
    assert [(s["state"], s["jobs"], s["core"]) for s in states] == \
        [("waiting (asleep)", 2, ex.cores[0])]
    assert states[0]["items"] > 0 and states[0]["for_ms"] >= 0
    assert "pool worker ft-moe-0" in ex.describe_workers()


def test_waiting_on_a_slow_job_spins_at_most_a_millisecond() -> None:
    """By CPU time: a caller that only waits (join off) spends about the bounded spin (1 ms)
    of a job's 50+ ms; one that joins (the default) spends its share of the items, and the
    process no more than the two threads' work."""
    _, ex, x, ids, w = _slow_job()
    ex.submit(x, ids, w, 0).wait()  # warm

    def one_job() -> tuple[float, float, float]:
        wall0, proc0 = time.perf_counter(), time.process_time()
        fut = ex.submit(x, ids, w, 0)
        mine0 = time.thread_time()
        fut.wait()
        return (time.thread_time() - mine0, time.perf_counter() - wall0,
                time.process_time() - proc0)

    ex.set_join(False)
    mine, wall, proc = one_job()
    assert wall > 0.05, f"the job is too quick to tell ({wall:.3f} s)"
    assert mine < 0.005, (mine, wall)  # the 1 ms spin, the futex and the call around it
    assert proc < 1.1 * wall + 0.01, (proc, wall)  # the worker's work alone
    ex.set_join(True)
    mine, wall, proc = one_job()
    assert proc < 2.1 * wall + 0.01, (proc, wall)
