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


def test_with_several_layer_kinds_the_line_says_where_each_went():
    times = {"steps": 0, "tokens": 0, "schedule_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
    kinds = {"q8_0": {"layers": 29, "fetch_s": 1.0, "compute_s": 0.0, "cpu_s": 0.5, "plan_s": 0.2},
             "bf16": {"layers": 1, "fetch_s": 0.5, "compute_s": 0.0, "cpu_s": 0.1, "plan_s": 0.0}}
    moe = {"hit_rate": 0.1, "bytes_per_token": 1e6, "fetch_s": 1.5, "compute_s": 0.0,
           "cpu_s": 0.6, "plan_s": 0.2, "kinds": kinds}
    line = decode_line(10.0, {**BASE, "times": {**times, "tokens": 100}, "moe": moe},
                       {**BASE, "times": times})
    assert line.endswith("; by layer kind: bf16 (1 layers) fetch 5.0, compute 0.0, CPU 1.0, "
                         "host plan 0.0; q8_0 (29 layers) fetch 10.0, compute 0.0, CPU 5.0, "
                         "host plan 2.0")
    one = decode_line(10.0, {**BASE, "times": {**times, "tokens": 100},
                             "moe": {**moe, "kinds": {"q8_0": kinds["q8_0"]}}},
                      {**BASE, "times": times})
    assert "by layer kind" not in one


def test_the_line_shows_the_look_ahead_prediction_when_there_is_one():
    moe = {"hit_rate": 0.871, "bytes_per_token": 2.5e8, "lookahead_hit_rate": 0.835}
    line = decode_line(10.0, {**BASE, "moe": moe})
    assert ", expert cache hit rate 87.1 % (look-ahead predicted 84 %), 250.0 MB/token" in line
    line = decode_line(10.0, {**BASE, "moe": moe | {"lookahead_hit_rate": None}})
    assert ", expert cache hit rate 87.1 %, 250.0 MB/token" in line


def test_the_cpu_strategys_pool_jobs_are_in_the_line():
    times = {"steps": 0, "tokens": 0, "schedule_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
    before = {**BASE, "times": times, "cpu_pool": {"calls": 480, "step_s": 0.2, "job_s": 0.1}}
    now = {**BASE, "times": {**times, "tokens": 100, "forward_s": 2.5},
           "cpu_pool": {"calls": 5280, "step_s": 2.2, "job_s": 1.6}}
    # 100 tokens, 4800 layer calls: jobs 1.5 s, steps 2.0 s
    assert decode_line(40.0, now, before).endswith(
        "; CPU pool: jobs 15.0 ms, host steps 20.0 ms a token")
    idle = {**now, "cpu_pool": before["cpu_pool"]}  # no host step since the last line
    assert "CPU pool" not in decode_line(40.0, idle, before)
