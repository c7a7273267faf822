"""Which cores this process may use (affinity mask and cgroup CPU quota, not the machine's
count), and who runs on them: the engine thread, torch's intra-op threads and the CPU pool's
pinned workers never share a core by accident (:class:`CorePlan`; :func:`pin_beside_pool`
keeps the process's other threads off the workers' cores)."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or what the platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_BEFORE_PIN: list[int] | None = None  # usable_cores() before pin_beside_pool narrowed the mask


def usable_cores() -> list[int]:
    """Cores in the affinity mask, cut to the cgroup quota (cpu.max) when one is set (the
    process's, as it was before :func:`pin_beside_pool`)."""
    if _BEFORE_PIN is not None:
        return list(_BEFORE_PIN)
    cores = sorted(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    if quota is not None and quota < len(cores):
        cores = cores[: max(1, quota)]
    return cores


def _cgroup_quota() -> int | None:
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    if not text or text[0] == "max":
        return None
    return math.floor(int(text[0]) / int(text[1]))


def plan_cores(usable: list[int], threads: int | None) -> list[int]:
    """The core each worker is pinned to: one per usable core, the first left to the main thread.

    With an explicit ``threads`` beyond that, workers wrap around the usable cores.
    """
    if not usable:
        raise ValueError("no usable cores")
    workers = usable[1:] or usable
    n = threads if threads is not None else len(workers)
    if n < 1:
        raise ValueError(f"--moe-cpu-threads must be at least 1, got {n}")
    order = workers + [c for c in usable if c not in workers]
    return [order[i % len(order)] for i in range(n)]


def describe_cores(cores: list[int]) -> str:
    """``core 3``, ``cores 1..15`` or ``cores 1,4,7`` for a startup line."""
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return f"core {cores[0]}" if len(cores) == 1 else f"cores {cores[0]}..{cores[-1]}"
    return "cores " + ",".join(map(str, cores))


@dataclass(frozen=True)
class CorePlan:
    """Who runs where in the engine process.

    The first usable core is the engine thread's; torch's intra-op threads (the engine thread
    is one of them) take the cores the pool leaves; each pool worker is pinned to a core of
    its own. A ``--moe-cpu-threads`` that would leave the engine thread no core is cut to the
    cores there are (``asked`` keeps what was asked). On a single usable core the one worker
    and the engine thread share it: both block when they wait, so neither starves the other.
    The API process is another process, idle between requests, and not pinned.
    """

    usable: tuple[int, ...]
    workers: tuple[int, ...] = ()
    torch_threads: int = 1
    asked: int | None = None  # the worker count asked for, when the plan gives fewer

    @property
    def engine(self) -> int:
        return self.usable[0]

    @property
    def spare(self) -> list[int]:
        """The cores the pool's workers leave (the engine thread's, torch's)."""
        return [c for c in self.usable if c not in self.workers] or [self.engine]

    def line(self) -> str:
        """The startup line: every thread of the engine process and its cores."""
        text = (f"core plan: {len(self.usable)} usable ({describe_cores(list(self.usable))}); "
                f"engine thread on core {self.engine}, torch {self.torch_threads} intra-op "
                f"thread{'s' * (self.torch_threads != 1)} on {describe_cores(self.spare)}")
        if not self.workers:
            return text + "; no CPU pool"
        pinned = describe_cores(list(self.workers))
        text += f"; CPU pool {len(self.workers)} workers pinned to {pinned}"
        if self.workers == (self.engine,):
            text += " (one usable core: shared with the engine thread, both block when waiting)"
        return text

    def shrink_note(self) -> str | None:
        """Why the pool has fewer workers than asked, or None."""
        if self.asked is None:
            return None
        if len(self.usable) == 1:
            return (f"--moe-cpu-threads {self.asked} on one usable core (affinity mask and "
                    "cgroup quota): the CPU pool has 1 worker, sharing it with the engine thread")
        return (f"--moe-cpu-threads {self.asked} would leave the engine thread no core of its "
                f"own ({len(self.usable)} usable: affinity mask and cgroup quota): the CPU pool "
                f"has {len(self.workers)} workers, one per core beside the engine thread's")


def core_plan(usable: list[int], pool: bool, threads: int | None = None) -> CorePlan:
    """The plan for ``usable`` cores; ``pool``: whether a CPU pool runs; ``threads``: the
    workers asked for (None: one per usable core but the engine thread's)."""
    if not usable:
        raise ValueError("no usable cores")
    if not pool:
        return CorePlan(tuple(usable), (), len(usable))
    if threads is not None and threads < 1:
        raise ValueError(f"--moe-cpu-threads must be at least 1, got {threads}")
    free = usable[1:]
    if not free:
        return CorePlan(tuple(usable), (usable[0],), 1,
                        threads if threads is not None and threads > 1 else None)
    n = len(free) if threads is None else threads
    asked = n if n > len(free) else None
    n = min(n, len(free))
    return CorePlan(tuple(usable), tuple(free[:n]), len(usable) - n, asked)


def pin_beside_pool(plan: CorePlan) -> list[int] | None:
    """Keep every thread of this process off the pool's cores but the workers: the threads
    there now (the caller, the engine thread to be, and its helpers) and those they start
    later (torch's intra-op threads, the CUDA driver's; the workers pin themselves) get the
    cores the plan leaves, so none of them takes a worker's core by accident. Call it before
    the pool starts. Returns those cores, or None where nothing was pinned (no pool, the one
    usable core shared, no affinity masks). :func:`usable_cores` answers as before, so a later
    plan is the same plan."""
    global _BEFORE_PIN
    spare = plan.spare
    if not plan.workers or set(spare) & set(plan.workers) or not hasattr(os, "sched_setaffinity"):
        return None
    if _BEFORE_PIN is None:
        _BEFORE_PIN = usable_cores()
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), spare)
        except OSError:  # a thread that has exited meanwhile
            pass
    return spare
