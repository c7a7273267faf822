"""Which cores this process may use (affinity mask and cgroup CPU quota, not the machine's
count), and where the CPU pool's workers go on them."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores() -> list[int]:
    """Cores in the affinity mask, cut to the cgroup quota (cpu.max) when one is set."""
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
