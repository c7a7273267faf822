"""A live server with the CPU pool (cpu strategy) asked through `ft ctl`: health, stats and the
thread stacks of both processes; SIGUSR1 writes stacks to the log and the server keeps serving;
an idle server costs (almost) no CPU time, measured by the kernel's accounting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.server.conftest import Server, start_server

TICK = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def pool_server(tmp_path_factory: pytest.TempPathFactory):
    from freetoken.cpu.library import available

    if available() is not None:
        pytest.skip(str(available()))
    d = tmp_path_factory.mktemp("ctl")
    model = d / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)
    server = start_server(["--model", str(model), "--moe-strategy", "cpu", "--moe-cpu-threads",
                           "1", "--max-seq-len", "256", "--kv-tokens", "2048"], d / "server.log")
    yield server
    server.stop()


def _ctl(server: Server, what: str) -> subprocess.CompletedProcess[str]:
    port = str(urlparse(server.url).port)
    return subprocess.run([sys.executable, "-m", "freetoken.cli", "ctl", what, "--port", port],
                          capture_output=True, text=True, timeout=120)


def _complete(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": "tiny.gguf", "prompt": "hello there", "max_tokens": 8})
    assert r.status_code == 200, r.text


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def test_ctl_health_and_stats(pool_server):
    _complete(pool_server)
    r = _ctl(pool_server, "health")
    assert r.returncode == 0 and '"status": "ok"' in r.stdout, r.stderr
    r = _ctl(pool_server, "stats")
    assert r.returncode == 0 and '"engine_info"' in r.stdout and '"pid"' in r.stdout


def test_ctl_stacks_shows_both_processes(pool_server):
    r = _ctl(pool_server, "stacks")
    assert r.returncode == 0, r.stderr
    api, _, engine = r.stdout.partition("engine process (pid")
    assert "API process (pid" in api and "--- thread MainThread" in api
    assert "engine-reader" in api  # the thread that routes the engine's events
    assert "in engine_main" in engine and "--- thread stack-responder" in engine
    # the CPU pool's worker (no Python stack): its state from the library, waiting when idle
    worker = next(ln for ln in engine.splitlines() if ln.startswith("--- pool worker ft-moe-0"))
    assert "waiting" in worker and " jobs, " in worker


def test_ctl_without_a_server_is_a_one_line_error():
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "ctl", "health", "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("ft ctl: error: no ft serve answers at "
                                                        "127.0.0.1:1")


def test_sigusr1_writes_stacks_to_the_log_and_serving_goes_on(pool_server):
    engine = httpx.get(f"{pool_server.url}/v1/stats", timeout=30).json()["engine_info"]["pid"]
    before = pool_server.log.read_text()
    os.kill(engine, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while "most recent call first" not in pool_server.log.read_text()[len(before):]:
        assert time.monotonic() < deadline, "no stacks in the log after SIGUSR1"
        time.sleep(0.2)
    os.kill(pool_server.proc.pid, signal.SIGUSR1)  # the API process too
    time.sleep(1)
    _complete(pool_server)
    assert pool_server.proc.poll() is None


def test_an_idle_server_spends_almost_no_cpu(pool_server):
    """After a request has run through the pool, 10 idle seconds cost each process under 0.2 s
    of CPU time (the engine blocks on its pipe, the pool's workers sleep after a bounded spin)."""
    _complete(pool_server)
    engine = httpx.get(f"{pool_server.url}/v1/stats", timeout=30).json()["engine_info"]["pid"]
    time.sleep(1)  # the last spins end
    pids = {"engine": engine, "api": pool_server.proc.pid}
    start = {k: _cpu_seconds(p) for k, p in pids.items()}
    time.sleep(10)
    spent = {k: _cpu_seconds(p) - start[k] for k, p in pids.items()}
    assert all(s < 0.2 for s in spent.values()), spent


def test_a_step_longer_than_the_watchdog_time_is_logged_with_its_phase(tmp_path):
    """The embedded model prefilling a long prompt in one step (about a second on two cores)
    against a 0.2 s watchdog: one warning naming the phase and the engine thread's frame in
    the package, the end of the episode logged, and /health and /v1/stats healthy after."""
    server = start_server(["--max-seq-len", "1024", "--max-prefill-length", "1024",
                           "--kv-tokens", "2048", "--watchdog-s", "0.2"], tmp_path / "wd.log")
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "one two three four " * 220, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 800
        time.sleep(1.0)  # a stats interval
        watch = httpx.get(f"{server.url}/v1/stats").json()["engine"]["watchdog"]
        assert watch["stuck"] is False
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    finally:
        server.stop()
    log = (tmp_path / "wd.log").read_text()
    line = next(ln for ln in log.splitlines() if "engine watchdog: no progress" in ln)
    assert "in phase 'forward' at " in line and ".py:" in line
    assert "progress again" in log
