"""A greedy request under hybrid gives resident's tokens whatever the split measures: its
steps fetch every miss (``--moe-hybrid-greedy fetch``), where the CPU would compute some
experts in other bits than the device's path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from freetoken.config import CacheSizing, EngineConfig
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sample import SamplingParams
from freetoken.engine.scheduler import Scheduler, Sequence

PROMPT = [5, 300, 41, 270, 99, 1, 400, 256, 12, 77]


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("greedy") / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def _run(path, strategy: str, params: SamplingParams, greedy: str = "fetch"
         ) -> tuple[list[int], dict | None]:
    """The tokens of one request, and the expert cache's stats (None without one). Hybrid
    fetches one miss a call and gives the rest to the CPU, its split corrected online."""
    cfg = EngineConfig(model=str(path), device="cpu", dtype="float32", moe_strategy=strategy,
                       max_seq_len=128, moe_cpu_threads=1, moe_cache=CacheSizing("size", 3),
                       moe_hybrid_max_fetch=1, moe_hybrid_greedy=greedy)
    runner = ModelRunner(cfg, kv_tokens=256, progress=False)
    s = Scheduler(runner, max_running=1, prefix_cache=False)
    s.add(Sequence("r", PROMPT, params))
    tokens = []
    while s.has_work():
        tokens += [e.token for e in s.step() if e.token is not None]
    stats = runner.offload.stats.snapshot(False) if runner.offload is not None else None
    return tokens, stats


def test_greedy_hybrid_is_resident_bit_for_bit(tiny_q8, monkeypatch):
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", "/nonexistent/none.json")
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    resident, _ = _run(tiny_q8, "resident", greedy)
    tokens, stats = _run(tiny_q8, "hybrid", greedy)
    assert tokens == resident and len(tokens) == 24
    assert stats is not None and stats["misses"] > 0 and stats["cpu_experts"] == 0
    # the same request with the split left alone gives the CPU its share
    _, split = _run(tiny_q8, "hybrid", greedy, greedy="split")
    assert split is not None and split["cpu_experts"] > 0
    # and a sampled request is split as ever
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3)
    _, stats = _run(tiny_q8, "hybrid", sampled)
    assert stats is not None and stats["cpu_experts"] > 0
