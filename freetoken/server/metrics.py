"""Prometheus metrics of the API process (one registry per server)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("freetoken_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("freetoken_generation_tokens", "generated tokens",
                                         registry=r)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("freetoken_inter_token_latency_seconds", "time between tokens",
                             buckets=_LATENCY, registry=r)
        self.running = Gauge("freetoken_running_requests", "requests in the batch", registry=r)
        self.waiting = Gauge("freetoken_queue_depth", "requests waiting for KV", registry=r)
        self.kv_usage = Gauge("freetoken_kv_usage", "fraction of KV pages in use", registry=r)
        self.prefix_hits = Gauge("freetoken_prefix_cache_hit_tokens",
                                 "prompt tokens served from the prefix cache", registry=r)
        self.moe = {key: Gauge(f"freetoken_moe_{key}", help_, registry=r) for key, help_ in (
            ("hits", "expert cache hits of offloaded layers since start"),
            ("misses", "expert cache misses (fetched experts) since start"),
            ("streamed", "experts streamed through staging buffers (prefill) since start"),
            ("hit_rate", "expert cache hits / lookups since start"),
            ("bytes_fetched", "expert bytes copied host -> device since start"),
            ("bytes_per_token", "expert bytes copied host -> device per token"),
            ("fetch_s", "seconds spent copying experts host -> device"),
            ("compute_s", "seconds spent computing offloaded experts expert by expert"),
            ("plan_s", "host seconds planning gathered expert calls (split, CPU submit, "
                       "copies, slot tables; not the wait for the CPU's share)"),
            ("prefetched", "experts look-ahead fetched before their layer asked, since start"),
            ("lookahead_hit_rate", "routed experts that look-ahead had predicted / routed "
                                   "experts (NaN before any prediction)"),
        )}
        self.cpu_pool = {key: Gauge(f"freetoken_cpu_pool_{key}", help_, registry=r)
                         for key, help_ in (
            ("calls", "cpu-strategy layer calls run between decode graph pieces since start"),
            ("job_s", "seconds the CPU pool spent on those calls' jobs"),
            ("step_s", "engine-thread seconds of those host steps, the jobs included"),
        )}

    def engine_stats(self, stats: dict[str, Any]) -> None:
        if stats:
            self.running.set(stats["running"])
            self.waiting.set(stats["waiting"])
            self.kv_usage.set(stats["kv_usage"])
            self.prefix_hits.set(stats["prefix_hit_tokens"])
            for key, gauge in self.moe.items():
                if "moe" in stats:
                    value = stats["moe"][key]
                    gauge.set(float("nan") if value is None else value)
            for key, gauge in self.cpu_pool.items():
                if "cpu_pool" in stats:
                    gauge.set(stats["cpu_pool"][key])
