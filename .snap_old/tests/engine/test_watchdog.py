"""The engine watchdog on real threads: a phase that makes no progress and an engine thread
spinning while the CPU pool idles are each reported once, with where the thread is, and end
when the thread moves on; idle time and a healthy loop of steps are never reported."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from freetoken.cpu import executor as cx
from freetoken.engine import watchdog as wd
from freetoken.engine.watchdog import IDLE, Watchdog


def _engine_thread(body, *args):
    """Run ``body(watchdog, *args)`` on a thread that owns a watchdog; returns its changes."""
    changes: list[dict] = []
    box: dict = {}

    def main():
        box["w"] = Watchdog(stall_s=0.3, interval_s=0.1, on_change=changes.append)
        try:
            body(box["w"], *args)
        finally:
            box["w"].close()

    t = threading.Thread(target=main)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive()
    return changes


def blocked_in_a_lock(w: Watchdog, seconds: float) -> None:
    w.step()
    w.enter("forward")
    threading.Event().wait(seconds)  # a wait that never ends in time, as a stuck device sync
    w.enter(IDLE)
    time.sleep(0.3)


def test_a_phase_without_progress_is_reported_once_with_where_it_is(caplog):
    with caplog.at_level(logging.INFO, logger="freetoken.engine.watchdog"):
        changes = _engine_thread(blocked_in_a_lock, 1.0)
    assert [c["stuck"] for c in changes] == [True, False]
    first = changes[0]
    assert first["phase"] == "forward" and first["why"] == "no progress"
    assert first["at"].startswith("wait threading.py:")  # innermost frame: no package frame
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "phase 'forward'" in warnings[0]
    assert "ft ctl stacks" in warnings[0]
    assert any("progress again" in r.getMessage() for r in caplog.records)


def idle_then_steps(w: Watchdog) -> None:
    w.enter(IDLE)
    time.sleep(0.6)  # idle for twice the stall time
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # short healthy steps
        w.step()
        w.enter("forward")
        time.sleep(0.005)
        w.enter(wd.BETWEEN_STEPS)


def test_idle_time_and_healthy_steps_are_not_stuck():
    assert _engine_thread(idle_then_steps) == []


def spin_beside_a_pool(w: Watchdog, seconds: float,
                       reported: list[dict] | None = None) -> None:
    """Burn the engine thread's core beside an idle pool for ``seconds``, or, with
    ``reported``, until the watchdog has reported (``seconds`` at most): a box busy with other
    work may take a few looks longer to show the spin."""
    ex = cx.CpuMoeExecutor(threads=1, spin_us=0)  # its worker sleeps: the pool idles
    try:
        w.step()
        w.enter("forward")
        end = time.monotonic() + seconds
        x = 0
        while time.monotonic() < end and not reported:  # no step ends
            x += 1
        w.enter(IDLE)
        time.sleep(0.3)
    finally:
        ex.close()


@pytest.mark.skipif(cx.available() is not None, reason=f"no CPU library: {cx.available()}")
def test_an_engine_thread_spinning_while_the_pool_idles_is_reported(monkeypatch):
    monkeypatch.setattr(wd, "SPIN_SHARE", 0.5)  # a loaded 2-core box gives the spin less
    # the stall time is longer than the spin: only the CPU accounting can tell
    changes: list[dict] = []
    box: dict = {}

    def main():
        box["w"] = Watchdog(stall_s=30, interval_s=0.25, spin_s=0.5, on_change=changes.append)
        try:
            spin_beside_a_pool(box["w"], 20, changes)
        finally:
            box["w"].close()

    t = threading.Thread(target=main)
    t.start()
    t.join(timeout=40)
    assert changes and changes[0]["stuck"] and "CPU pool idles" in changes[0]["why"]
    assert changes[0]["engine_cpu"] >= 0.5 and changes[0]["pool_cpu"] < wd.POOL_IDLE_SHARE
    assert "spin_beside_a_pool" in changes[0]["at"] or "test_watchdog.py" in changes[0]["at"]
    assert not changes[-1]["stuck"]


@pytest.mark.skipif(cx.available() is not None, reason=f"no CPU library: {cx.available()}")
def test_a_burn_shorter_than_the_spin_time_is_not_reported(monkeypatch):
    """A second of torch-like work on the engine thread beside an idle pool (a long prefill's
    attention) is work, not a spin: only a burn that lasts ``spin_s`` is reported."""
    monkeypatch.setattr(wd, "SPIN_SHARE", 0.5)
    changes: list[dict] = []

    def main():
        w = Watchdog(stall_s=30, interval_s=0.25, spin_s=5.0, on_change=changes.append)
        try:
            spin_beside_a_pool(w, 1.0)
        finally:
            w.close()

    t = threading.Thread(target=main)
    t.start()
    t.join(timeout=30)
    assert changes == []


def test_a_stall_time_must_be_positive():
    with pytest.raises(ValueError, match="stall time"):
        Watchdog(stall_s=0)
