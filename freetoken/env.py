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


BENCHBW_PATH = "FREETOKEN_BENCHBW_PATH"  # set for child processes that must read one profile


def benchbw_path() -> Path | None:
    """FREETOKEN_BENCHBW_PATH: the bandwidth profile file (``ft bench bw``); unset means
    ``cache_dir() / "benchbw.json"``."""
    value = os.environ.get(BENCHBW_PATH, "").strip()
    return Path(value).expanduser() if value else None


def git_sha() -> str | None:
    """FREETOKEN_GIT_SHA: the commit to record in bench results when the tree was copied
    without its git history; unset means ask git."""
    return os.environ.get("FREETOKEN_GIT_SHA", "").strip() or None


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """Variable ``name``, one of ``choices`` (unset or empty: the first), or a clear error."""
    value = os.environ.get(name, "").strip().lower() or choices[0]
    if value not in choices:
        from freetoken.errors import ConfigError

        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}; unset it for "
                          f"{choices[0]}")
    return value


ROW_COPIES = ("native", "torch")
EXPERT_SLOTS = ("native", "python")


def layer_call() -> str:
    """FREETOKEN_LAYER_CALL: who plans an offloaded layer's decode call between graph pieces
    (route, split, the CPU's job, the copies, the slot table): ``native`` (default, one
    library call, where the library makes the slot decisions) or ``python`` (the slow twin:
    a call into the library per step)."""
    return _choice("FREETOKEN_LAYER_CALL", EXPERT_SLOTS)


def expert_slots() -> str:
    """FREETOKEN_EXPERT_SLOTS: who makes the expert cache's slot decisions (LRU, hits and
    misses, the hybrid split's fetched and CPU experts): ``native`` (default, the library,
    where it loads) or ``python`` (the slow twin)."""
    return _choice("FREETOKEN_EXPERT_SLOTS", EXPERT_SLOTS)


def row_copy() -> str:
    """FREETOKEN_ROW_COPY: how an offloaded layer's misses are copied into the expert cache:
    ``native`` (default: one library call queues a call's copies and their stream ordering)
    or ``torch`` (a torch copy per expert: the slow twin)."""
    return _choice("FREETOKEN_ROW_COPY", ROW_COPIES)


GPU_EXPERT_KERNELS = ("auto", "fused", "dequant")


def gpu_expert_kernel() -> str:
    """FREETOKEN_GPU_EXPERT_KERNEL: how cached experts are computed on the GPU in decode:
    ``fused`` (slots read in place by Triton kernels: Q8_0, Q5_0, Q4_K, Q5_K, Q6_K, MXFP4),
    ``dequant`` (slots copied out, dequantised, batched matmuls: resident's bits) or ``auto``
    (default: fused where every projection's format has a kernel and triton imports)."""
    return _choice("FREETOKEN_GPU_EXPERT_KERNEL", GPU_EXPERT_KERNELS)


CPU_ACTS = ("auto", "f32", "q8")


def cpu_act() -> str:
    """FREETOKEN_CPU_ACT: how the CPU pool's integer kernels read activations: ``auto``
    (default: int8 blocks where a SIMD kernel is faster so), ``f32`` (as float32: an expert's
    output within float rounding of the GPU's, for greedy text that does not depend on which
    side computed it) or ``q8``."""
    return _choice("FREETOKEN_CPU_ACT", CPU_ACTS)


GPU_DENSE = ("blocks", "dequant")


def gpu_dense() -> str:
    """FREETOKEN_GPU_DENSE: how dense matrices stored as Q8_0 sit on a GPU: ``blocks``
    (default: kept as Q8_0x8 blocks, half of bf16's memory, read once a decode step by the
    fused kernel, ``layers/block_linear.py``; with the int8_x reader resident decode 2 %
    faster than dequantised on an H100) or ``dequant`` (dequantised to the compute dtype at
    load: cuBLAS's matmuls, the bits of the checkpoint's weights in that dtype)."""
    return _choice("FREETOKEN_GPU_DENSE", GPU_DENSE)


GPU_PDL = ("on", "off")


def gpu_pdl() -> str:
    """FREETOKEN_GPU_PDL: whether the GPU's Triton kernels are programmatic dependent launches
    (compute capability 9 and above): ``on`` (default) lets a kernel start while the one
    before it ends and wait inside for that one's results, which hides part of a launch in a
    graph (resident decode 3-5 % faster on an H100); ``off`` launches each after the one
    before ends."""
    return _choice("FREETOKEN_GPU_PDL", GPU_PDL)


GRAPH_LAUNCHES = ("driver", "torch")


def graph_launch() -> str:
    """FREETOKEN_GRAPH_LAUNCH: how the pieces of a decode step in pieces are launched:
    ``driver`` (default: ``cuGraphLaunch`` on the current stream, every piece but the last,
    ``engine/graph_launch.py``) or ``torch`` (``CUDAGraph.replay``, which also refills the
    random generators' seeds: 17.5 us of the host's time a piece on an H100)."""
    return _choice("FREETOKEN_GRAPH_LAUNCH", GRAPH_LAUNCHES)


GPU_ROUTER = ("fused", "matmul")


def gpu_router() -> str:
    """FREETOKEN_GPU_ROUTER: how a decode step routes its tokens on a GPU: ``fused``
    (default: the router's matmul and the routing in one kernel,
    ``kernels/token_steps.py:route_from_hidden``) or ``matmul`` (the router's matmul, then
    the routing kernel)."""
    return _choice("FREETOKEN_GPU_ROUTER", GPU_ROUTER)


RESIDENT_BLOCKS = ("regrouped", "file")


def resident_blocks() -> str:
    """FREETOKEN_RESIDENT_BLOCKS: how resident experts kept as blocks on a GPU lie there:
    ``regrouped`` (default: Q8_0 rows of whole 256-weight groups as Q8_0x8, which the fused
    kernel reads 16 bytes a load with x as int8 blocks; resident decode 11 % faster on an
    H100) or ``file`` (the file's blocks as they are, as the expert cache holds them:
    offload's kernels, so resident's bits are offload's)."""
    return _choice("FREETOKEN_RESIDENT_BLOCKS", RESIDENT_BLOCKS)


CPU_HOST_NODES = ("flag", "off", "on")
WALL_CHECKS = ("on", "off")


def gemv_launch() -> str:
    """FREETOKEN_GEMV_LAUNCH: launch choices of the fused gather-GEMV kernels that replace
    ``kernels/gather_gemv.py``'s table, for tuning on another GPU: ``fmt=rows,step,warps``
    entries (``,1`` or ``,0`` after them: bit-operation conversions or not, q8_0 and mxfp4;
    then for q8_0x8 ``,1`` to sum a block's products before its scale, then ``,1`` to read x
    as int8 blocks with integer dots, ``int8_x``) separated by spaces
    (``q8_0=4,16,2``), as ``benchmarks/gather_gemv.py --sweep`` prints them; unset means
    the table."""
    return os.environ.get("FREETOKEN_GEMV_LAUNCH", "").strip()


def wall_check() -> str:
    """FREETOKEN_WALL_CHECK: whether an online hybrid split is checked against other fetched
    shares by the decode steps' own wall time (``moe/wall_check.py``): ``on`` (default) or
    ``off`` (the online cost model alone decides the split)."""
    return _choice("FREETOKEN_WALL_CHECK", WALL_CHECKS)


def cpu_host_node() -> str:
    """FREETOKEN_CPU_HOST_NODE: how decode CUDA graphs run the cpu strategy's pool jobs:
    ``flag`` (default: each job inside the graph, served by the engine thread on flags the
    graph writes and waits for in pinned memory: one replay a step, ``cpu/graph_flags.py``;
    a host step where the driver lacks stream memory operations), ``off`` (a host step
    between two graph pieces per layer) or ``on`` (each job a host node inside the graph, run
    by the CUDA driver's thread). On an H100 (48-layer qwen3-30b-a3b q8_0, 15 threads) cpu
    decoded 51.7 and 49.3 tok/s on flags, 43.4 with host steps, 43.6 with host nodes
    (f88b0bf)."""
    return _choice("FREETOKEN_CPU_HOST_NODE", CPU_HOST_NODES)


HOST_STEPS = ("early", "pieces", "flags")
LATE_STEPS = ("breaks", "flags")


def host_steps() -> str:
    """FREETOKEN_HOST_STEPS: where decode CUDA graphs run an offloaded or hybrid layer's host
    plan: ``early`` (default: between two graph pieces, after a sync for the routed ids, and the
    next piece is launched as soon as the plan's own copies, slot table and look-ahead are
    queued: the call's stats and bookkeeping come after it, off the GPU's path), ``pieces``
    (the same, the next piece launched once the whole plan has returned) or ``flags`` (inside
    the graph: the graph sets a flag in pinned memory, the engine thread plans on a side stream
    that sets the flag the graph waits for, ``cpu/graph_flags.py``; needs the CUDA driver's
    stream memory operations). On an H200 (48-layer qwen3-30b-a3b q8_0, 4 GB cache,
    temperature 1, a9b9a4b) hybrid online decoded 55.2 and 47.1 tok/s early against 47.3 and
    42.1 between pieces, in two rounds; on an H100 (24 layers, 4f50af5) flags lost 9 % to
    pieces."""
    return _choice("FREETOKEN_HOST_STEPS", HOST_STEPS)


def late_steps() -> str:
    """FREETOKEN_LATE_STEPS: how a decode graph whose plans run between its pieces takes the
    CPU's result of a plan (hybrid's share): ``breaks`` (default: a step between two more
    pieces waits for the pool's job, copies the result in and launches the next piece) or
    ``flags`` (the piece waits on a flag the pool sets as the job ends, then copies the
    result in itself: no break, no wake-up of the engine thread before the GPU goes on;
    where the driver has stream memory operations). On an H100 at ba5d48c ``flags`` decoded
    hybrid at 48.0 tok/s against 56.3 in two runs each: look-ahead's hits fell (29-36 % against
    42 %)."""
    return _choice("FREETOKEN_LATE_STEPS", LATE_STEPS)


PREFILL_DEQUANTS = ("expert", "chunk")


def prefill_dequant() -> str:
    """FREETOKEN_PREFILL_DEQUANT: how a prompt's streamed experts are dequantised before their
    matmuls: ``expert`` (default: one by one) or ``chunk`` (a staging chunk's experts
    together, a projection at a time: fewer, larger copies, the same bits; on the CPU it took
    2.2x as long, its large buffers fresh each time; not yet measured on a GPU)."""
    return _choice("FREETOKEN_PREFILL_DEQUANT", PREFILL_DEQUANTS)


HYBRID_PREFETCH = 0.4  # measured on qwen3-30b-a3b q8_0, 48 layers (moe/hybrid.py)


def hybrid_prefetch() -> float:
    """FREETOKEN_HYBRID_PREFETCH: the share (0 to 1) of the next layer's predicted misses a
    hybrid layer fetches while it computes, or the split's share where that is more (0: the
    split's share alone); unset means 0.4. ``--moe-lookahead off`` fetches none."""
    value = os.environ.get("FREETOKEN_HYBRID_PREFETCH", "").strip()
    if not value:
        return HYBRID_PREFETCH
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        from freetoken.errors import ConfigError

        raise ConfigError(f"FREETOKEN_HYBRID_PREFETCH={value!r} is not a share from 0 to 1; "
                          f"unset it for {HYBRID_PREFETCH}")
    return share
