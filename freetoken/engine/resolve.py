"""Parsed engine flags -> a frozen, logged EngineConfig: device, dtype, graphs, dense layers
and torch's threads made concrete, every flag validated. The MoE flags' ``auto`` needs the
checkpoint and the device's memory and is resolved in the engine process (``moe/plan.py``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from freetoken.checkpoint import default_model_path, open_checkpoint
from freetoken.config import KV_RESERVE_TOKENS, MOE_CPU_SPIN_US, CacheSizing, EngineConfig
from freetoken.cpu.cores import core_plan, pin_beside_pool, usable_cores
from freetoken.cpu.library import available as native_available
from freetoken.errors import ConfigError
from freetoken.moe.plan import wants_pool
from freetoken.moe.registry import AUTO

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def configure_threads(cfg: EngineConfig | None = None, pin: bool = False) -> int:
    """torch's intra-op threads: one per usable core (affinity mask and cgroup quota), less the
    cores the CPU expert pool takes when the strategy (or one ``auto`` may pick) needs it.
    ``pin`` (a process that runs one engine, before its pool starts): the process's threads
    are kept off the pool's cores (:func:`pin_beside_pool`)."""
    pool = cfg is not None and wants_pool(cfg)
    plan = core_plan(usable_cores(), pool, (cfg.moe_cpu_threads or None) if cfg else None)
    torch.set_num_threads(plan.torch_threads)
    if pin:
        pin_beside_pool(plan)
    return plan.torch_threads


def _cpu_dense(device: str, strategy: str, model: str) -> str:
    """``--cpu-dense auto``: the pool on the CPU where the library loads and the experts (if
    any) are on the pool too (measured: Gemma-3 270M decodes 43 tok/s there against 7 in
    torch on two cores); torch otherwise, and for resident experts in torch, whose threads
    the pool would take."""
    if device != "cpu" or native_available() is not None:
        return "torch"
    if strategy in (AUTO, "cpu"):
        return "pool"
    try:
        dense = not open_checkpoint(model).config.is_moe
    except Exception:  # the runner reports a bad checkpoint with its own message
        return "torch"
    return "pool" if dense else "torch"


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
    cache = _cache_sizing(args)
    if getattr(args, "kv_reserve_tokens", 0) < 0:
        raise ConfigError(f"--kv-reserve-tokens must be >= 0, got {args.kv_reserve_tokens}")
    if args.moe_cpu_threads < 0:
        raise ConfigError(f"--moe-cpu-threads must be >= 0, got {args.moe_cpu_threads}")
    spin = getattr(args, "moe_cpu_spin_us", MOE_CPU_SPIN_US)
    if not 0 <= spin <= 100_000:
        raise ConfigError(f"--moe-cpu-spin-us must be within 0..100000, got {spin}")
    max_fetch = getattr(args, "moe_hybrid_max_fetch", AUTO)
    if max_fetch != AUTO:
        if not str(max_fetch).isdigit() or int(max_fetch) < 1:
            raise ConfigError(f"--moe-hybrid-max-fetch must be auto or a count >= 1, "
                              f"got {max_fetch!r}")
        max_fetch = int(max_fetch)
    cpu_dense = getattr(args, "cpu_dense", "auto")
    if cpu_dense == "auto":
        cpu_dense = _cpu_dense(device, args.moe_strategy, model)
    if cpu_dense == "pool" and device != "cpu":
        raise ConfigError("--cpu-dense pool runs dense layers on the CPU; it needs --device cpu")
    cfg = EngineConfig(
        model=model, device=device, dtype=dtype, moe_strategy=args.moe_strategy,
        max_seq_len=args.max_seq_len, cuda_graph_max_bs=graphs,
        moe_cpu_threads=args.moe_cpu_threads, moe_cpu_spin_us=spin, moe_cache=cache,
        kv_reserve_tokens=getattr(args, "kv_reserve_tokens", KV_RESERVE_TOKENS),
        moe_hybrid_max_fetch=max_fetch,
        moe_hybrid_online=getattr(args, "moe_hybrid_online", "on") == "on",
        moe_hybrid_greedy=getattr(args, "moe_hybrid_greedy", "fetch"),
        moe_lookahead=getattr(args, "moe_lookahead", "auto"),
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
