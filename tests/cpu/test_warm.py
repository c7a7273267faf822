"""Warm reads (``Executor::warm``): a layer's experts read into the CPU's caches on the pool in
the background, every byte of them when nothing interrupts; the next job cancels what is left
and computes what it computes without one, bit for bit."""

from __future__ import annotations

import time

import pytest
import torch

from freetoken.cpu import executor as cx
from tests.cpu.test_kernels import E, inputs, make_bank, stacks

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


def _expert_bytes(bank) -> int:
    """Bytes of one expert's gate, up and down (whole cache lines of each)."""
    return sum(t.data[0].numel() * t.data.element_size() // 64 * 64
               for t in (bank.gate, bank.up, bank.down))


def _wait_for(ex: cx.CpuMoeExecutor, nbytes: int, timeout_s: float = 10.0) -> int:
    t0 = time.monotonic()
    while (got := ex.warm_stats()[1]) < nbytes and time.monotonic() - t0 < timeout_s:
        time.sleep(0.001)
    return got


def test_a_warm_read_reads_the_experts_it_is_given_and_returns_at_once() -> None:
    bank = make_bank("bf16", 256, 512)
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(bank))
    assert ex.warm_stats() == (0, 0)
    assert ex.warm(0, torch.tensor([3, 1], dtype=torch.int32))
    assert ex.warm_stats()[0] == 1
    assert _wait_for(ex, 2 * _expert_bytes(bank)) == 2 * _expert_bytes(bank)
    time.sleep(0.01)  # nothing more is read
    assert ex.warm_stats() == (1, 2 * _expert_bytes(bank))
    assert ex.warm(0, torch.tensor([], dtype=torch.int32))  # ends the last one, reads nothing
    assert ex.warm_stats() == (1, 2 * _expert_bytes(bank))


def test_the_next_job_cancels_a_warm_read_and_computes_the_same_bits() -> None:
    """A read of every expert of a large layer on one worker takes milliseconds; the job
    submitted right after it ends it early and gives the output it gives without one."""
    big = make_bank("bf16", 1024, 1024)
    small = make_bank("q8_0", 96, 160)
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(big))
    ex.add_layer(1, *stacks(small))
    x, ids, w = inputs("q8_0", 3)
    want = ex.run(x, ids, w, layer=1)
    total = E * _expert_bytes(big)
    for how in ("run", "submit", "linear"):
        reads, before = ex.warm_stats()
        assert ex.warm(0, torch.arange(E, dtype=torch.int32))
        if how == "run":
            got = ex.run(x, ids, w, layer=1)
        elif how == "submit":
            got = ex.submit(x, ids, w, layer=1).wait()
        else:
            from freetoken.quant import get_format

            lid = ex.add_linear(cx.ExpertStack.from_quant(get_format("q8_0").quantize(
                torch.randn(40, 96))))
            ex.run_linear(torch.randn(2, 96), lid)
            got = ex.run(x, ids, w, layer=1)
        assert torch.equal(got, want)
        after = ex.warm_stats()
        assert after[0] == reads + 1
        assert after[1] - before < total, "the job did not cancel the warm read"
        time.sleep(0.02)
        assert ex.warm_stats()[1] == after[1], "a cancelled read went on reading"


def test_warm_reads_and_jobs_in_turn_lose_nothing() -> None:
    """As a decode step does it, layer after layer: a job, then a warm read of the next
    layer's experts, 300 times; every job's output is the one computed alone."""
    banks = [make_bank("q8_0", 96, 160, seed=s) for s in range(2)]
    ex = cx.CpuMoeExecutor(threads=2)
    for layer, bank in enumerate(banks):
        ex.add_layer(layer, *stacks(bank))
    x, ids, w = inputs("q8_0", 2)
    want = [ex.run(x, ids, w, layer=layer) for layer in range(2)]
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        layer = i % 2
        assert torch.equal(ex.run(x, ids, w, layer=layer), want[layer])
        ex.warm(1 - layer, torch.randperm(E, generator=g)[:3].to(torch.int32))
    assert ex.warm_stats()[0] == 300
    ex.close()  # with a read in flight: it is ended first


def test_bad_warm_reads_are_refused_clearly() -> None:
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(make_bank("q8_0", 96, 160)))
    with pytest.raises(ValueError, match="layer 5 is not on the pool"):
        ex.warm(5, torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="outside layer 0's experts"):
        ex.warm(0, torch.tensor([E], dtype=torch.int32))
    with pytest.raises(ValueError, match="more than"):
        ex.warm(0, torch.zeros(ex.warm_max + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        ex.warm(0, torch.tensor([0]))
    assert ex.warm_stats() == (0, 0)


def test_a_warm_read_waits_its_turn_when_jobs_hold_the_slots() -> None:
    """Jobs in flight hold every slot but one: a warm read then reads nothing (it would take
    the slot the next job needs) and says so."""
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(make_bank("q8_0", 96, 160)))
    futs = [ex.submit(*inputs("q8_0", 1), layer=0) for _ in range(cx.MAX_IN_FLIGHT - 1)]
    assert not ex.warm(0, torch.tensor([0], dtype=torch.int32))
    for f in futs:
        f.wait()
    assert ex.warm(0, torch.tensor([0], dtype=torch.int32))
    assert ex.warm_stats()[0] == 1
