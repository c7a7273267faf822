"""Every FREETOKEN_* environment variable, typed, in one place. Nothing else reads os.environ."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FREETOKEN_CACHE_DIR: converted tokenizers, the bandwidth profile; ~/.cache/freetoken."""
    return Path(os.environ.get("FREETOKEN_CACHE_DIR") or Path.home() / ".cache" / "freetoken")


def log_level() -> str:
    """FREETOKEN_LOG_LEVEL: debug, info (default), warning, error."""
    return os.environ.get("FREETOKEN_LOG_LEVEL", "info").upper()


def cpu_isa() -> str | None:
    """FREETOKEN_CPU_ISA: highest ISA tier the CPU expert kernels may use (scalar, avx2, avx512,
    avx512_vnni, avx512_bf16); unset means the best this CPU has. Validated by the executor."""
    return os.environ.get("FREETOKEN_CPU_ISA", "").strip().lower() or None


def benchbw_path() -> Path | None:
    """FREETOKEN_BENCHBW_PATH: the bandwidth profile file (``ft bench bw``); unset means
    ``cache_dir() / "benchbw.json"``."""
    value = os.environ.get("FREETOKEN_BENCHBW_PATH", "").strip()
    return Path(value).expanduser() if value else None


def git_sha() -> str | None:
    """FREETOKEN_GIT_SHA: the commit to record in bench results when the tree was copied
    without its git history; unset means ask git."""
    return os.environ.get("FREETOKEN_GIT_SHA", "").strip() or None


ROW_COPIES = ("native", "torch")
EXPERT_SLOTS = ("native", "python")


def layer_call() -> str:
    """FREETOKEN_LAYER_CALL: who plans an offloaded layer's decode call between graph pieces
    (route, split, the CPU's job, the copies, the slot table): ``native`` (default, one
    library call, where the library makes the slot decisions) or ``python`` (the slow twin:
    a call into the library per step)."""
    value = os.environ.get("FREETOKEN_LAYER_CALL", "native").strip().lower() or "native"
    if value not in EXPERT_SLOTS:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_LAYER_CALL={value!r} is not one of "
                          f"{', '.join(EXPERT_SLOTS)}; unset it for native")
    return value


def expert_slots() -> str:
    """FREETOKEN_EXPERT_SLOTS: who makes the expert cache's slot decisions (LRU, hits and
    misses, the hybrid split's fetched and CPU experts): ``native`` (default, the library,
    where it loads) or ``python`` (the slow twin)."""
    value = os.environ.get("FREETOKEN_EXPERT_SLOTS", "native").strip().lower() or "native"
    if value not in EXPERT_SLOTS:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_EXPERT_SLOTS={value!r} is not one of "
                          f"{', '.join(EXPERT_SLOTS)}; unset it for native")
    return value


def row_copy() -> str:
    """FREETOKEN_ROW_COPY: how an offloaded layer's misses are copied into the expert cache:
    ``native`` (default: one library call queues a call's copies and their stream ordering)
    or ``torch`` (a torch copy per expert: the slow twin)."""
    value = os.environ.get("FREETOKEN_ROW_COPY", "native").strip().lower() or "native"
    if value not in ROW_COPIES:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_ROW_COPY={value!r} is not one of "
                          f"{', '.join(ROW_COPIES)}; unset it for native")
    return value


GPU_EXPERT_KERNELS = ("auto", "fused", "dequant")


def gpu_expert_kernel() -> str:
    """FREETOKEN_GPU_EXPERT_KERNEL: how cached experts are computed on the GPU in decode:
    ``fused`` (slots read in place by Triton kernels: Q8_0, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4),
    ``dequant`` (slots copied out, dequantised, batched matmuls: resident's bits) or ``auto``
    (default: fused where every projection's format has a kernel and triton imports)."""
    value = os.environ.get("FREETOKEN_GPU_EXPERT_KERNEL", "auto").strip().lower() or "auto"
    if value not in GPU_EXPERT_KERNELS:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_GPU_EXPERT_KERNEL={value!r} is not one of "
                          f"{', '.join(GPU_EXPERT_KERNELS)}; unset it for auto")
    return value


CPU_HOST_NODES = ("off", "on")


def gemv_launch() -> str:
    """FREETOKEN_GEMV_LAUNCH: launch choices of the fused gather-GEMV kernels that replace
    ``kernels/gather_gemv.py``'s table, for tuning on another GPU: ``fmt=rows,step,warps``
    entries (``,1`` or ``,0`` after them: bit-operation conversions or not, q8_0 and mxfp4)
    separated by spaces (``q8_0=4,16,2``), as ``benchmarks/gather_gemv.py --sweep`` prints
    them; unset means the table."""
    return os.environ.get("FREETOKEN_GEMV_LAUNCH", "").strip()


def wall_check() -> str:
    """FREETOKEN_WALL_CHECK: whether an online hybrid split is checked against other fetched
    shares by the decode steps' own wall time (``moe/wall_check.py``): ``on`` (default) or
    ``off`` (the online cost model alone decides the split)."""
    value = os.environ.get("FREETOKEN_WALL_CHECK", "on").strip().lower() or "on"
    if value not in ("on", "off"):
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_WALL_CHECK={value!r} is not on or off; unset it for on")
    return value


def cpu_host_node() -> str:
    """FREETOKEN_CPU_HOST_NODE: how decode CUDA graphs run the cpu strategy's pool jobs:
    ``off`` (default: a host step between two graph pieces per layer) or ``on`` (each job a
    host node inside the graph, run by the CUDA driver's thread: one replay a step)."""
    value = os.environ.get("FREETOKEN_CPU_HOST_NODE", "off").strip().lower() or "off"
    if value not in CPU_HOST_NODES:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_CPU_HOST_NODE={value!r} is not one of "
                          f"{', '.join(CPU_HOST_NODES)}; unset it for off")
    return value
