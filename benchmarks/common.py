"""What every benchmark records about the run: the commit and the host."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path


def git_state(sha: str | None = None) -> dict[str, object]:
    """Commit and dirty flag; ``sha`` given where the tree was copied without .git."""
    if sha:
        return {"sha": sha, "dirty": None}

    def run(*cmd: str) -> str:
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"sha": run("git", "rev-parse", "HEAD"), "dirty": bool(run("git", "status", "-s"))}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def host() -> dict[str, object]:
    return {"host": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0))}
