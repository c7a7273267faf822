"""Waits on the GPU cost the waiting thread a bounded spin, not the wait: measured by the
thread's CPU time while the GPU is held busy far longer than the spin."""

from __future__ import annotations

import functools
import time

import pytest
import torch

pytestmark = pytest.mark.cuda

BUSY_S = 0.3  # how long the GPU is kept busy; the spin is 1 ms


@functools.cache
def _cycles_per_second() -> float:
    torch.cuda._sleep(1000)  # loaded first: its first launch is not timed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    return 1e8 / (start.elapsed_time(end) / 1e3)


def _busy_gpu(seconds: float) -> None:
    """Queue about ``seconds`` of GPU work on the current stream (a spin on the device)."""
    torch.cuda._sleep(int(seconds * _cycles_per_second()))


def _cpu_and_wall(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    _busy_gpu(BUSY_S)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu0, time.perf_counter() - wall0


@pytest.mark.parametrize("twin", ["library", "slow"])
def test_a_long_wait_sleeps_after_its_spin(twin):
    from freetoken.cpu.gpu_wait import GpuWait

    w = GpuWait(0, spin_us=1000)
    cpu, wall = _cpu_and_wall(w.wait if twin == "library" else w.slow)
    assert w.event.query()  # the work queued before the wait is done
    assert wall > 0.8 * BUSY_S, f"the GPU was busy {wall * 1e3:.0f} ms"
    assert cpu < 0.05, f"{cpu * 1e3:.1f} ms of CPU in a {wall * 1e3:.0f} ms wait"


def test_a_plain_synchronize_spins_the_whole_wait():
    """Guards the test above: CUDA's default wait does burn the thread's core."""
    cpu, wall = _cpu_and_wall(torch.cuda.synchronize)
    assert wall > 0.8 * BUSY_S, f"the GPU was busy {wall * 1e3:.0f} ms"
    assert cpu > 0.5 * wall, f"{cpu * 1e3:.1f} ms of CPU in a {wall * 1e3:.0f} ms wait"


def test_to_host_gives_the_values_after_a_bounded_wait():
    from freetoken.cpu.gpu_wait import to_host

    x = torch.arange(1000, device="cuda")
    torch.cuda.synchronize()
    _busy_gpu(BUSY_S)
    y = x * 3
    cpu0 = time.thread_time()
    got = to_host(y)
    assert time.thread_time() - cpu0 < 0.05
    assert torch.equal(got, torch.arange(1000) * 3)


def test_a_host_steps_copies_and_sync_sleep_too():
    from freetoken.cpu.row_copy import RowCopier, Spans, current_stream

    src = torch.arange(64, dtype=torch.float32, device="cuda")
    dst = torch.zeros(64, dtype=torch.float32, pin_memory=True)
    copier = RowCopier(cuda=True)
    spans = Spans([(dst, src)])
    cpu, wall = _cpu_and_wall(lambda: copier.run(spans, current_stream(0), sync=True))
    assert wall > 0.8 * BUSY_S, f"the GPU was busy {wall * 1e3:.0f} ms"
    assert cpu < 0.05, f"{cpu * 1e3:.1f} ms of CPU in a {wall * 1e3:.0f} ms wait"
    assert torch.equal(dst, torch.arange(64, dtype=torch.float32))
