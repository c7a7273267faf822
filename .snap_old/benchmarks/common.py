"""What every benchmark records about the run (the commit and the host), and where it goes."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def git_state(sha: str | None = None) -> dict[str, object]:
    """Commit and dirty flag of this checkout. Where the tree was copied without .git, the
    commit comes from ``sha`` or FREETOKEN_GIT_SHA, else it is "unknown" (git is not asked
    from another folder, which would name some other repository's commit)."""
    sha = sha or os.environ.get("FREETOKEN_GIT_SHA")
    if sha:
        return {"sha": sha, "dirty": None}
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return {"sha": "unknown", "dirty": None}

    def run(*cmd: str) -> str:
        r = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"sha": run("rev-parse", "HEAD"), "dirty": bool(run("status", "-s"))}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def host() -> dict[str, object]:
    return {"host": socket.gethostname(), "platform": platform.platform(), "cpu": cpu_model(),
            "cores": len(os.sched_getaffinity(0))}


def save_result(out: Path, stem: str, result: dict[str, Any]) -> Path:
    """Write ``result`` to ``out/<stem>-<unix time>.json`` and return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}-{int(time.time())}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
