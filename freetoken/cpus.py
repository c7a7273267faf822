"""Which cores this process may use: affinity mask and cgroup CPU quota, not the machine's count."""

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
