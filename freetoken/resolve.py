"""Every 'auto' becomes a concrete value here, logged, before the config is frozen."""

from __future__ import annotations

import logging
from typing import Any

import torch

from freetoken.checkpoint import default_model_path
from freetoken.config import EngineConfig
from freetoken.cpus import usable_cores
from freetoken.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


def configure_threads(cfg: EngineConfig | None = None) -> int:
    """torch's intra-op threads: one per usable core (affinity mask and cgroup quota), less the
    cores the CPU expert pool takes when the cpu strategy runs."""
    usable = len(usable_cores())
    threads = usable
    if cfg is not None and cfg.moe_strategy == "cpu":
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
    if args.moe_cpu_threads < 0:
        raise ConfigError(f"--moe-cpu-threads must be >= 0, got {args.moe_cpu_threads}")
    cfg = EngineConfig(
        model=model, device=device, dtype=dtype, moe_strategy=args.moe_strategy,
        max_seq_len=args.max_seq_len, cuda_graph_max_bs=graphs,
        moe_cpu_threads=args.moe_cpu_threads,
    )
    threads = configure_threads(cfg)
    log.info("resolved engine config: model=%s device=%s dtype=%s moe_strategy=%s "
             "max_seq_len=%d cuda_graph_max_bs=%d%s torch_threads=%d", model, device, dtype,
             cfg.moe_strategy, cfg.max_seq_len, graphs, " (eager on cpu)" if
             device == "cpu" else "", threads)
    return cfg
