"""A live server with offloaded or hybrid experts: the same completions as resident, and the
expert cache's counters in /v1/stats, /metrics and the engine's periodic log line."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    return str(out)


def _complete(url: str, prompt: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    r = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=16,
                                  temperature=0)
    return [r.choices[0].text]


PROMPTS = ["hello world", "the quick brown fox", "one two three four"]


@pytest.fixture(scope="module")
def want(tiny_gguf, tmp_path_factory) -> list[list[str]]:
    """Resident's greedy completions of PROMPTS."""
    log = tmp_path_factory.mktemp("resident") / "resident.log"
    resident = start_server(["--model", tiny_gguf], log)
    try:
        return [_complete(resident.url, p) for p in PROMPTS]
    finally:
        resident.stop()


def test_offload_server_reports_cache_stats(tiny_gguf, tmp_path, want):
    prompts = PROMPTS
    server = start_server(["--model", tiny_gguf, "--moe-strategy", "offload",
                           "--moe-cache-size", "3"], tmp_path / "offload.log")
    try:
        assert [_complete(server.url, p) for p in prompts] == want
        time.sleep(0.7)  # one stats interval
        moe = httpx.get(f"{server.url}/v1/stats").json()["engine"]["moe"]
        assert moe["hits"] > 0 and moe["misses"] > 0 and moe["bytes_fetched"] > 0
        assert set(moe["layers"]) == {"0", "1"}
        assert moe["tokens"] >= sum(len(p.split()) for p in prompts) + 3 * 15
        metrics = httpx.get(f"{server.url}/metrics").text
        values = {m.split()[0]: float(m.split()[1]) for m in metrics.splitlines()
                  if m.startswith("freetoken_moe_")}
        assert values["freetoken_moe_misses"] == moe["misses"]
        # look-ahead (on for offload by default) fetched for layer 1 and changed no output
        assert moe["prefetched"] > 0 and values["freetoken_moe_prefetched"] == moe["prefetched"]
        assert 0 < moe["lookahead_hit_rate"] == values["freetoken_moe_lookahead_hit_rate"]
        assert moe["layers"]["0"]["lookahead_hit_rate"] is None
    finally:
        assert server.stop() == 0
    log = (tmp_path / "offload.log").read_text()
    assert "resolved moe_cache_size=3 " in log and "MoE plan: offload on 2 q8_0 layers" in log


@pytest.mark.parametrize("greedy", ["fetch", "split"])
def test_hybrid_server_serves_concurrent_requests(tiny_gguf, tmp_path, monkeypatch, want,
                                                  greedy):
    """Hybrid with a 3-slot cache, the greedy prompts at once (batched layer calls): resident's
    completions. By default (``--moe-hybrid-greedy fetch``) their steps fetch every miss, the
    split corrected online as it is served: resident's bits, the CPU idle. With ``split`` the
    calls split between fetching and the CPU pool, whose share shows in /v1/stats."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    flags = ["--moe-hybrid-greedy", greedy]
    if greedy == "split":
        # Which misses go to the CPU depends on what the batch holds at each step, and that on
        # when each request arrives. With the pool's int8 activations an expert computed there
        # differs from the slots' float path by enough to flip a near-tied greedy token (seen
        # in 1 of 5 runs); with float32 activations (FREETOKEN_CPU_ACT=f32) the two differ by
        # float rounding only. The split is held fixed as well: moved online it follows
        # measured times.
        monkeypatch.setenv("FREETOKEN_CPU_ACT", "f32")
        flags += ["--moe-hybrid-online", "off"]
    server = start_server(["--model", tiny_gguf, "--moe-strategy", "hybrid", "--moe-cache-size",
                           "3", "--moe-cpu-threads", "1", *flags], tmp_path / "hybrid.log")
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
        assert got == want
        time.sleep(0.7)  # one stats interval
        moe = httpx.get(f"{server.url}/v1/stats").json()["engine"]["moe"]
        assert moe["misses"] > 0 and (moe["cpu_experts"] > 0) == (greedy == "split")
        assert all("fetch_fraction" in s for s in moe["layers"].values())
    finally:
        assert server.stop() == 0
    assert "MoE plan: hybrid on 2 q8_0 layers" in (tmp_path / "hybrid.log").read_text()


@pytest.mark.parametrize("flags", [["--moe-cache-size", "0"], ["--moe-cache-rate", "1.5"],
                                   ["--moe-cache-mem", "1KB"]])
def test_bad_cache_flags_are_one_line_errors(tiny_gguf, flags):
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve", "--device", "cpu",
                        "--model", tiny_gguf, "--moe-strategy", "offload", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error: " in last and "--moe-cache-" in last, r.stderr
