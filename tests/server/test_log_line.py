"""The periodic engine log line: where a token's time went since the previous line."""

from __future__ import annotations

from freetoken.server.process import decode_line

BASE = {"running": 2, "waiting": 0, "kv_usage": 0.25}


def test_the_line_splits_a_token_between_two_lines():
    before = {**BASE, "times": {"steps": 10, "tokens": 10, "schedule_s": 0.01, "forward_s": 0.2,
                                "sample_s": 0.05},
              "moe": {"fetch_s": 1.0, "compute_s": 0.1, "cpu_s": 0.5, "plan_s": 0.2}}
    now = {**BASE, "times": {"steps": 60, "tokens": 110, "schedule_s": 0.11, "forward_s": 2.2,
                             "sample_s": 0.55},
           "moe": {"hit_rate": 0.5, "bytes_per_token": 2e6, "fetch_s": 2.0, "compute_s": 0.2,
                   "cpu_s": 1.5, "plan_s": 0.7}}
    line = decode_line(40.0, now, before)
    assert line.startswith("engine: 40.0 tokens/s, running 2, waiting 0, KV 25 %, expert cache "
                           "hit rate 50.0 %, 2.0 MB/token fetched")
    # 100 tokens: (0.1 + 2.0 + 0.5) s -> 26 ms a token
    assert "; per token 26.0 ms: schedule 1.0, forward 20.0, sample + wait 5.0" in line
    assert "(experts: fetch 10.0, compute 1.0, CPU 10.0, host plan 5.0)" in line


def test_without_tokens_or_experts_the_line_stays_short():
    times = {"steps": 3, "tokens": 3, "schedule_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
    line = decode_line(1.0, {**BASE, "times": times}, {**BASE, "times": times})
    assert line == "engine: 1.0 tokens/s, running 2, waiting 0, KV 25 %"
