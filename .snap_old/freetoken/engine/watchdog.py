"""The engine's watchdog: a thread of its own that notices a step making no progress, or an
engine thread burning a core while the CPU pool idles, and says where it is.

The engine thread only writes two fields per phase (:meth:`Watchdog.enter`); everything else
happens on the watchdog's thread, which sleeps between looks (an ``Event.wait``, never a spin).
Each look reads the engine thread's and the pool workers' CPU time from ``/proc`` (the kernel's
accounting, so a spinning native wait shows as well as Python) and, when something is wrong,
the engine thread's innermost frame in this package from ``sys._current_frames`` (no ptrace).
One warning per episode goes to the log; :attr:`Watchdog.state` is what ``/health`` and
``/v1/stats`` show.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

POOL_THREAD_PREFIX = "ft-moe-"  # csrc/thread_pool.cpp names its workers ft-moe-<index>
IDLE = "idle"  # waiting for requests: never stuck
BETWEEN_STEPS = "between steps"  # the engine loop's own work: reading requests, sending events
# An engine thread at or above this share of a core while the pool's workers together stay
# under POOL_IDLE_SHARE of one core and fewer than SLOW_STEPS_PER_S steps end, through a whole
# look, is spinning rather than working (a healthy offloaded decode makes tens of steps a
# second; the pool's workers run the CPU share of every hybrid or cpu step).
SPIN_SHARE = 0.9
POOL_IDLE_SHARE = 0.1
SLOW_STEPS_PER_S = 2.0


def _cpu_seconds(tid: int) -> float | None:
    """User + system CPU seconds of thread ``tid`` of this process, or None if gone."""
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pool_threads() -> list[int]:
    out = []
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            if (task / "comm").read_text().startswith(POOL_THREAD_PREFIX):
                out.append(int(task.name))
        except (OSError, ValueError):
            continue
    return out


def where(thread_ident: int) -> str:
    """The innermost frame of this package in the thread's Python stack (``func file:line``),
    or its innermost frame of any code when none is ours."""
    frame = sys._current_frames().get(thread_ident)
    first = None
    while frame is not None:
        code = frame.f_code
        text = f"{code.co_name} {Path(code.co_filename).name}:{frame.f_lineno}"
        first = first or text
        if f"{os.sep}freetoken{os.sep}" in code.co_filename:
            return text
        frame = frame.f_back
    return first or "no Python frame"


class Watchdog:
    """Watches the thread that creates it (the engine thread).

    ``stall_s``: a phase that lasts longer than this is stuck. ``interval_s``: how often to
    look (and the window over which CPU shares are measured). ``spin_s``: how long the engine
    thread must burn its core beside an idle pool, look after look, to count as spinning (a
    long prefill has seconds of torch work on that thread alone). ``on_change``: called on the
    watchdog's thread with :attr:`state` when an episode starts or ends (the engine process
    sends it to the API process, whose engine thread may be the one stuck).
    """

    def __init__(self, stall_s: float, interval_s: float = 1.0, spin_s: float = 10.0,
                 on_change: Callable[[dict[str, Any]], None] | None = None) -> None:
        if stall_s <= 0:
            raise ValueError(f"the watchdog's stall time must be > 0 s, got {stall_s}")
        self.stall_s, self.interval_s, self.on_change = stall_s, interval_s, on_change
        self.spin_s = spin_s
        self._spinning_since: float | None = None  # when the spin condition began to hold
        self.phase, self.since, self.steps = IDLE, time.monotonic(), 0
        self.state: dict[str, Any] = {"stuck": False}
        self._ident, self._tid = threading.get_ident(), threading.get_native_id()
        self._stop = threading.Event()
        self._last: tuple[float, float | None, float, int] | None = None
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._thread.start()

    # -- the engine thread's side: a few stores ----------------------------------------------
    def enter(self, phase: str) -> None:
        """The engine thread starts ``phase`` (``IDLE`` when it has nothing to do)."""
        self.phase, self.since = phase, time.monotonic()

    def step(self) -> None:
        """A step begins (its first phase: scheduling)."""
        self.steps += 1
        self.enter("schedule")

    # -- the watchdog's thread ----------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.look()

    def _shares(self, now: float) -> tuple[float | None, float | None, float | None]:
        """The engine thread's and the pool's CPU share (of one core) and the steps per second
        since the last look."""
        engine = _cpu_seconds(self._tid)
        pool = [s for s in map(_cpu_seconds, _pool_threads()) if s is not None]
        pool_s = sum(pool) if pool else None
        last, self._last = self._last, (now, pool_s, engine or 0.0, self.steps)
        if last is None or engine is None or now <= last[0]:
            return None, None, None
        wall = now - last[0]
        pool_share = None if pool_s is None or last[1] is None else (pool_s - last[1]) / wall
        return (engine - last[2]) / wall, pool_share, (self.steps - last[3]) / wall

    def look(self) -> dict[str, Any]:
        """One look (the thread calls it every interval; tests call it directly)."""
        now = time.monotonic()
        phase, since = self.phase, self.since
        engine, pool, rate = self._shares(now)
        for_s = now - since
        stuck = phase != IDLE and for_s > self.stall_s
        burning = (phase != IDLE and engine is not None and engine >= SPIN_SHARE
                   and pool is not None and pool < POOL_IDLE_SHARE
                   and rate is not None and rate < SLOW_STEPS_PER_S)
        if not burning:
            self._spinning_since = None
        elif self._spinning_since is None:
            self._spinning_since = now - self.interval_s  # the look's window held it already
        spinning = burning and now - self._spinning_since >= self.spin_s
        state: dict[str, Any] = {"stuck": stuck or spinning, "phase": phase,
                                 "for_s": round(for_s, 1), "engine_cpu": engine,
                                 "pool_cpu": pool, "steps_per_s": rate}
        if state["stuck"]:
            state["at"] = where(self._ident)
            state["why"] = ("no progress" if stuck else
                            "engine thread busy while the CPU pool idles")
        started = state["stuck"] and not self.state["stuck"]
        ended = self.state["stuck"] and not state["stuck"]
        self.state = state
        if started:
            log.warning("engine watchdog: %s for %.1f s in phase %r at %s (engine thread "
                        "%s of a core, CPU pool %s); `ft ctl stacks` shows every thread",
                        state["why"], for_s, phase, state["at"], _pct(engine), _pct(pool))
        elif ended:
            log.info("engine watchdog: the engine thread left phase %r; progress again", phase)
        if (started or ended) and self.on_change is not None:
            self.on_change(state)
        return state


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f} %"
