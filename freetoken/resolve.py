"""Every 'auto' becomes a concrete value here, logged, before the config is frozen."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from freetoken.checkpoint import default_model_path
from freetoken.config import CacheSizing, EngineConfig, human_bytes
from freetoken.cpus import usable_cores
from freetoken.errors import ConfigError
from freetoken.moe.expert_cache import PoolPlan
from freetoken.moe.layer_kind import LayerKind, layer_span

log = logging.getLogger(__name__)

CPU_POOL_STRATEGIES = ("cpu", "hybrid", "auto")  # strategies that start the CPU expert pool
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def configure_threads(cfg: EngineConfig | None = None) -> int:
    """torch's intra-op threads: one per usable core (affinity mask and cgroup quota), less the
    cores the CPU expert pool takes when the cpu strategy runs."""
    usable = len(usable_cores())
    threads = usable
    if cfg is not None and (cfg.moe_strategy in CPU_POOL_STRATEGIES or cfg.cpu_dense == "pool"):
        workers = cfg.moe_cpu_threads or max(1, usable - 1)
        threads = max(1, usable - workers)
    torch.set_num_threads(threads)
    return threads


def resolve_engine(args: Any) -> EngineConfig:
    """Turn parsed engine flags into a frozen EngineConfig, and set torch's CPU threads."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    model = str(args.model) if args.model else str(default_model_path())
    if args.max_seq_len < 2:
        raise ConfigError(f"--max-seq-len must be at least 2, got {args.max_seq_len}")
    if args.cuda_graph_max_bs < 0:
        raise ConfigError(f"--cuda-graph-max-bs must be >= 0, got {args.cuda_graph_max_bs}")
    graphs = args.cuda_graph_max_bs if device == "cuda" else 0
    if graphs and args.moe_strategy == "cpu":
        log.info("--moe-strategy cpu: decode runs eagerly (CUDA graphs are not captured)")
        graphs = 0
    cache = _cache_sizing(args)
    if getattr(args, "kv_reserve_tokens", 0) < 0:
        raise ConfigError(f"--kv-reserve-tokens must be >= 0, got {args.kv_reserve_tokens}")
    if args.moe_cpu_threads < 0:
        raise ConfigError(f"--moe-cpu-threads must be >= 0, got {args.moe_cpu_threads}")
    spin = getattr(args, "moe_cpu_spin_us", 1000)
    if not 0 <= spin <= 100_000:
        raise ConfigError(f"--moe-cpu-spin-us must be within 0..100000, got {spin}")
    max_fetch = getattr(args, "moe_hybrid_max_fetch", "auto")
    if max_fetch != "auto":
        if not str(max_fetch).isdigit() or int(max_fetch) < 1:
            raise ConfigError(f"--moe-hybrid-max-fetch must be auto or a count >= 1, "
                              f"got {max_fetch!r}")
    cpu_dense = getattr(args, "cpu_dense", "auto")
    if cpu_dense == "auto":
        cpu_dense = "pool" if device == "cpu" and args.moe_strategy == "cpu" else "torch"
    if cpu_dense == "pool" and device != "cpu":
        raise ConfigError("--cpu-dense pool runs dense layers on the CPU; it needs --device cpu")
    cfg = EngineConfig(
        model=model, device=device, dtype=dtype, moe_strategy=args.moe_strategy,
        max_seq_len=args.max_seq_len, cuda_graph_max_bs=graphs,
        moe_cpu_threads=args.moe_cpu_threads, moe_cpu_spin_us=spin, moe_cache=cache,
        kv_reserve_tokens=getattr(args, "kv_reserve_tokens", 8192),
        moe_hybrid_max_fetch=0 if max_fetch == "auto" else int(max_fetch),
        moe_hybrid_online=getattr(args, "moe_hybrid_online", "on") == "on",
        cpu_dense=cpu_dense,
    )
    threads = configure_threads(cfg)
    log.info("resolved engine config: model=%s device=%s dtype=%s moe_strategy=%s "
             "max_seq_len=%d cuda_graph_max_bs=%d%s torch_threads=%d cpu_dense=%s", model,
             device, dtype, cfg.moe_strategy, cfg.max_seq_len, graphs, " (eager on cpu)" if
             device == "cpu" else "", threads, cfg.cpu_dense)
    return cfg


def _cache_sizing(args: Any) -> CacheSizing:
    """The expert cache flag given (argparse keeps them mutually exclusive), validated."""
    mem = getattr(args, "moe_cache_mem", None)
    rate = getattr(args, "moe_cache_rate", None)
    size = getattr(args, "moe_cache_size", None)
    if mem is not None:
        try:
            return CacheSizing("mem", parse_bytes(mem))
        except ValueError as e:
            raise ConfigError(f"--moe-cache-mem: {e}") from e
    if rate is not None:
        if not 0 < rate <= 1:
            raise ConfigError(f"--moe-cache-rate must be in (0, 1], got {rate}")
        return CacheSizing("rate", rate)
    if size is not None:
        if size < 1:
            raise ConfigError(f"--moe-cache-size must be at least 1 slot, got {size}")
        return CacheSizing("size", size)
    return CacheSizing()


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``4GB`` (10^9), ``512MiB`` (2^20), ``1.5e9`` -> bytes; ValueError names the bad value."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"{text!r} is not a size; write it like 4GB, 512MiB or 2.5e9")
    return int(value * _UNITS[unit])


@dataclass(frozen=True)
class ExpertGroup:
    """Offloaded layers whose experts take the same bytes (they share one slot pool)."""

    slot_bytes: int
    layers: tuple[int, ...]
    experts_per_layer: int

    @property
    def experts(self) -> int:
        return len(self.layers) * self.experts_per_layer


def plan_moe_cache(sizing: CacheSizing, groups: list[ExpertGroup],
                   free_bytes: int | None = None) -> list[PoolPlan]:
    """Slots per pool from the cache flag. ``free_bytes`` (for ``auto``) is what the device
    has left for the cache after the weights and the KV floor. Each pool gets at most one slot
    per expert of its layers and at least one; a flag too small for that is an error."""
    total_bytes = sum(g.slot_bytes * g.experts for g in groups)
    total_experts = sum(g.experts for g in groups)
    if sizing.kind in ("mem", "auto"):
        budget = sizing.value if sizing.kind == "mem" else float(free_bytes or 0)
        slots = [int(budget * g.slot_bytes * g.experts / total_bytes) // g.slot_bytes
                 for g in groups]
    elif sizing.kind == "rate":
        slots = [math.ceil(sizing.value * g.experts) for g in groups]
    elif sizing.kind == "size":
        shares = [sizing.value * g.experts / total_experts for g in groups]
        slots = [int(s) for s in shares]
        by_remainder = sorted(range(len(groups)), key=lambda i: slots[i] - shares[i])
        for i in by_remainder[: int(sizing.value) - sum(slots)]:
            slots[i] += 1
    else:
        raise ConfigError(f"unknown expert cache sizing {sizing.kind!r}")
    plans = []
    for g, n in zip(groups, slots, strict=True):
        if n < 1:
            where = f"one {human_bytes(g.slot_bytes)} expert of layers {layer_span(g.layers)}"
            if sizing.kind == "size":
                least = f"{len(groups)} slots, one per expert size"
            else:  # the budget that gives every pool its first slot
                least = human_bytes(max(total_bytes / h.experts for h in groups))
            what = "the free device memory" if sizing.kind == "auto" else sizing.describe()
            raise ConfigError(
                f"{what} leaves no room for {where}; the expert cache needs at least {least} "
                "(give a larger --moe-cache-mem, --moe-cache-rate or --moe-cache-size, or "
                "lower --kv-reserve-tokens)")
        plans.append(PoolPlan(g.slot_bytes, min(n, g.experts), g.layers))
    n_slots = sum(p.num_slots for p in plans)
    log.info("resolved moe_cache_size=%d (%s, %.1f %% of %d experts) from %s%s", n_slots,
             human_bytes(sum(p.num_slots * p.slot_bytes for p in plans)),
             100 * n_slots / total_experts,
             total_experts, sizing.describe(),
             "" if len(plans) == 1 else "; pools: " + ", ".join(
                 f"{p.num_slots} x {human_bytes(p.slot_bytes)} for layers "
                 f"{layer_span(p.layers)}" for p in plans))
    return plans


def plan_auto(kinds: dict[LayerKind, list[int]], num_layers: int, layer_bytes: int,
              budget: int, recommend: Callable[[LayerKind], str | None]) -> tuple[str, ...]:
    """``--moe-strategy auto`` per layer: resident while ``layer_bytes`` per layer fit in
    ``budget`` (device memory left after the dense weights, the KV floor and the expert cache),
    then per layer kind what its profile row recommends (``hybrid`` or ``offload``), else offload.
    ``recommend(kind)`` returns the row's recommendation or None when the kind has no row."""
    plan = ["resident"] * num_layers
    moe = sorted(layer for layers in kinds.values() for layer in layers)
    fit = max(0, min(len(moe), budget // layer_bytes)) if layer_bytes else len(moe)
    rest = set(moe[fit:])
    unbenched = []
    for kind, layers in kinds.items():
        rec = recommend(kind) if rest & set(layers) else None
        if rest & set(layers) and rec is None:
            unbenched.append(kind)
        for layer in layers:
            if layer in rest:
                plan[layer] = rec or "offload"
    if unbenched:
        log.info("--moe-strategy auto: no bandwidth profile row for %s; those layers offload. "
                 "Run `ft bench bw --model <checkpoint>` to let auto choose hybrid where it is "
                 "faster", ", ".join(k.key(0)[:-3] for k in unbenched))
    counts: dict[str, int] = {}
    for layer in moe:
        counts[plan[layer]] = counts.get(plan[layer], 0) + 1
    log.info("--moe-strategy auto: %s", ", ".join(f"{s} on {n} layer{'s' * (n != 1)}"
                                                  for s, n in counts.items()))
    return tuple(plan)
