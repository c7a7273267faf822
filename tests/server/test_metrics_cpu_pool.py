"""The cpu strategy's pool times reach ``/metrics`` as they reach ``/v1/stats``."""

from __future__ import annotations

from prometheus_client import generate_latest

from freetoken.server.metrics import Metrics


def _values(m: Metrics, prefix: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(m.registry).decode().splitlines():
        if line.startswith(prefix):
            name, value = line.split()
            out[name] = float(value)
    return out


def test_cpu_pool_gauges_follow_the_engine_stats() -> None:
    m = Metrics()
    base = {"running": 1, "waiting": 0, "kv_usage": 0.1, "prefix_hit_tokens": 0}
    m.engine_stats(base)  # a model without cpu layers: the gauges stay 0
    assert set(_values(m, "freetoken_cpu_pool_").values()) == {0.0}
    pool = {"calls": 96, "step_s": 0.05, "job_s": 0.03}
    m.engine_stats({**base, "cpu_pool": pool})
    assert _values(m, "freetoken_cpu_pool_") == {
        f"freetoken_cpu_pool_{k}": float(v) for k, v in pool.items()}
