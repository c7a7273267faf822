"""CPU MoE kernel bandwidth at decode batch sizes, next to a stream-read ceiling measured in the
same run by the same pinned workers.

Each call computes one MoE layer for a batch of T tokens with random top-k routing; the weight
bytes it reads are the routed experts' (each read once). The layers cycle over a working set
several times the L3, so weights come from DRAM as in decode. The ceiling is the pool reading a
large buffer with the widest loads the tier has, measured before and after each kernel run.

    python benchmarks/cpu_moe.py --fmt bf16,q8_0 --threads 1,2 --batch 1,2,3,4
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cpu_model, git_state, save_result  # noqa: E402
from benchmarks.common import host as machine  # noqa: E402
from freetoken.config import MOE_CPU_SPIN_US  # noqa: E402
from freetoken.cpu import executor as cx  # noqa: E402
from freetoken.quant import QuantTensor, get_format  # noqa: E402

GIB = 1 << 30


def l3_bytes() -> int:
    """Size of the largest cache level of cpu0 (sysfs), 32 MiB when it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def make_layer(fmt: str, hidden: int, inter: int, experts: int, seed: int,
               huge: bool = False) -> tuple[cx.ExpertStack, ...]:
    """A layer of random experts: 8 quantised ones, tiled to ``experts`` distinct copies."""
    g = torch.Generator().manual_seed(seed)
    q = get_format(fmt)
    stacks = []
    for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
        few = q.quantize(torch.randn(8, rows, cols, generator=g) / cols**0.5)
        reps = math.ceil(experts / 8)
        data = few.data.repeat(reps, *([1] * (few.data.dim() - 1)))[:experts].contiguous()
        scales = {k: (v.repeat(reps, *([1] * (v.dim() - 1)))[:experts].contiguous()
                      if v.dim() else v) for k, v in few.scales.items()}
        stacks.append(cx.ExpertStack.from_quant(
            QuantTensor(fmt, (experts, rows, cols), data, scales), copy=huge))
    return tuple(stacks)


def ceiling_gbps(ex: cx.CpuMoeExecutor, buf: torch.Tensor, seconds: float) -> float:
    """Best stream-read GB/s of the pool over ``buf`` (a few repetitions, about ``seconds``)."""
    best = 0.0
    end = time.perf_counter() + seconds
    while True:
        dt = ex.stream_read_seconds(buf, 1)
        best = max(best, buf.numel() / dt / 1e9)
        if time.perf_counter() > end:
            return best


def stream_mean_gbps(ex: cx.CpuMoeExecutor, buf: torch.Tensor, seconds: float) -> float:
    """Sustained stream-read GB/s of the pool: back-to-back reads of ``buf`` for ``seconds``,
    total bytes over total time (the statistic the kernel's figure is)."""
    n, spent = 0, 0.0
    while spent < seconds or n == 0:
        spent += ex.stream_read_seconds(buf, 1)
        n += 1
    return n * buf.numel() / spent / 1e9


def paired(ex: cx.CpuMoeExecutor, buf: torch.Tensor, layers: list[int], args: argparse.Namespace,
           T: int) -> dict[str, object]:
    """``args.pairs`` alternations of a sustained stream read and the kernel, ``args.pair_seconds``
    each, so that both see the same state of a shared host's memory system: the median of the
    per-pair ratios, by wall time per call and by the pool's time per job."""
    wall, pool, rows = [], [], []
    for _ in range(args.pairs):
        stream = stream_mean_gbps(ex, buf, args.pair_seconds)
        gbps, us, _, where = kernel_gbps(ex, layers, args.experts, args.top_k, args.hidden, T,
                                         args.pair_seconds)
        pool_gbps = gbps * us / where["pool_us"]
        wall.append(gbps / stream)
        pool.append(pool_gbps / stream)
        rows.append({"stream_gbps": round(stream, 2), "gbps": round(gbps, 2),
                     "pool_gbps": round(pool_gbps, 2)})
    return {"ratio_median": round(statistics.median(wall), 3),
            "pool_ratio_median": round(statistics.median(pool), 3),
            "pairs": rows}


def kernel_gbps(ex: cx.CpuMoeExecutor, layers: list[int], experts: int, top_k: int, hidden: int,
                T: int, seconds: float) -> tuple[float, float, int, dict[str, float]]:
    """Weight GB/s and µs per call of decode-like calls cycling over ``layers``, and where the
    pool's time went (means over calls, µs; busy and idle are summed over workers)."""
    g = torch.Generator().manual_seed(T)
    n = 64  # pre-drawn routings, so the loop times the kernel, not torch.randperm
    x = [torch.randn(T, hidden, generator=g) for _ in range(n)]
    ids = [torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(T)])
           for _ in range(n)]
    w = [torch.softmax(torch.randn(T, top_k, generator=g), -1) for _ in range(n)]
    for i in range(len(layers)):  # warm-up: first-touch and the pool's scratch
        ex.run(x[i % n], ids[i % n], w[i % n], layers[i])
    calls = nbytes = 0
    timings = []
    pool_s = 0.0
    ns = ctypes.c_int64(0)
    timed = ex.timing
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or calls < len(layers):
        args = x[calls % n], ids[calls % n], w[calls % n], layers[calls % len(layers)]
        if timed:  # a future carries the job's timing record
            fut = ex.submit(*args)
            fut.wait()
            nbytes += fut.weight_bytes
            pool_s += fut.seconds
            timings.append(fut.timing)
        else:  # the decode path: one call into the library
            nbytes += ex.run_measured(*args, ns=ns)[1]
            pool_s += ns.value / 1e9
        calls += 1
    dt = time.perf_counter() - start
    return nbytes / dt / 1e9, dt / calls * 1e6, calls, breakdown(timings, pool_s / calls,
                                                                 ex.threads + 1)


def breakdown(timings: list[cx.JobTiming], pool_s: float, workers: int) -> dict[str, float]:
    """Mean µs per call: the pool's time, its first item's start, each phase's end and busy
    time, down's waits for gate/up, and the workers' idle time (joining thread included)."""
    out = {"pool_us": pool_s * 1e6}
    if not timings:
        return out
    mean = lambda f: sum(f(t) for t in timings) / len(timings) * 1e6  # noqa: E731
    out["start_us"] = mean(lambda t: t.start)
    for p in range(4):
        out[f"end{p}_us"] = mean(lambda t, p=p: t.ends[p])
        out[f"busy{p}_us"] = mean(lambda t, p=p: t.busy[p])
    out["await_us"] = mean(lambda t: t.await_s)
    out["idle_us"] = workers * out["pool_us"] - sum(out[f"busy{p}_us"] for p in range(4))
    return {k: round(v, 1) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fmt", default="bf16,q8_0", help="comma-separated weight formats")
    p.add_argument("--threads", default="", help="comma-separated worker counts (default: the "
                   "executor's own, one per usable core but the first)")
    p.add_argument("--batch", default="1,2,3,4", help="comma-separated tokens per call")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--working-set-gib", type=float, default=0.0,
                   help="expert bytes to cycle over (default: max(4 x L3, 2 GiB))")
    p.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    p.add_argument("--isa", default=None, help="cap the ISA tier (default: the best)")
    p.add_argument("--spin-us", type=int, default=MOE_CPU_SPIN_US,
                   help="worker spin before sleeping")
    p.add_argument("--prefetch", default="", help="comma-separated prefetch distances in bytes "
                   "to compare, each optionally :LEVEL (0 = L1, 1 = L2), e.g. 2048,4096:1 "
                   "(default: the kernels' own)")
    p.add_argument("--down-split", default="auto", help="comma-separated down_proj splits to "
                   "compare: auto, rows, experts (see CpuMoeExecutor.set_down_split)")
    p.add_argument("--gate-up-rows", default="0", help="comma-separated rows per gate/up work "
                   "item to compare (0: the executor's default)")
    p.add_argument("--pairs", type=int, default=0, help="after each measurement, this many "
                   "alternations of a sustained stream read and the kernel (the paired ratio)")
    p.add_argument("--pair-seconds", type=float, default=0.3, help="per half of a pair")
    p.add_argument("--timing", action="store_true", help="time every work item and report "
                   "where each call's time went (phase ends, busy, idle, waits)")
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="expert banks and the ceiling buffer in huge-page-advised memory, as the "
                   "cpu strategy keeps them")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.pairs < 0 or args.pair_seconds <= 0:
        p.error("--pairs must be >= 0 and --pair-seconds > 0")

    l3 = l3_bytes()
    ws = int(args.working_set_gib * GIB) or max(4 * l3, 2 * GIB)
    fmts = args.fmt.split(",")
    threads = [int(t) for t in args.threads.split(",")] if args.threads else [None]
    batches = [int(b) for b in args.batch.split(",")]
    prefetches = args.prefetch.split(",") if args.prefetch else [None]
    splits = args.down_split.split(",")
    gate_up_rows = [int(r) for r in args.gate_up_rows.split(",")]
    nbuf = max(GIB, 4 * l3)
    buf = cx.host_buffer(nbuf) if args.huge_pages else torch.empty(nbuf, dtype=torch.uint8)
    buf.fill_(1)
    rows = []
    for fmt in fmts:
        per_layer = args.experts * cx.expert_bytes(fmt, args.hidden, args.intermediate)
        n_layers = max(1, math.ceil(ws / per_layer))
        stacks = [make_layer(fmt, args.hidden, args.intermediate, args.experts, seed=i,
                             huge=args.huge_pages) for i in range(n_layers)]
        for nt in threads:
            ex = cx.CpuMoeExecutor(threads=nt, isa=args.isa, spin_us=args.spin_us)
            for i, s in enumerate(stacks):
                ex.add_layer(i, *s)
            kernels = ex.layers[0].kernels
            ex.set_timing(args.timing)
            for ahead, split, rows1, T in itertools.product(prefetches, splits, gate_up_rows,
                                                            batches):
                if ahead is not None:
                    nbytes, _, level = ahead.partition(":")
                    cx.set_prefetch(int(nbytes), int(level or 0))
                ex.set_down_split(split)
                ex.set_gate_up_rows(rows1)
                before = ceiling_gbps(ex, buf, args.seconds / 2)
                gbps, us, calls, where = kernel_gbps(ex, list(range(n_layers)), args.experts,
                                                     args.top_k, args.hidden, T, args.seconds)
                ceiling = max(before, ceiling_gbps(ex, buf, args.seconds / 2))
                pairs = paired(ex, buf, list(range(n_layers)), args, T) if args.pairs else None
                row = {"fmt": fmt, "threads": ex.threads, "cores": ex.cores, "isa": ex.isa,
                       "kernels": kernels, "batch": T, "gbps": round(gbps, 2),
                       "ceiling_gbps": round(ceiling, 2), "ratio": round(gbps / ceiling, 3),
                       "us_per_call": round(us, 1), "calls": calls, "prefetch": ahead,
                       "down_split": split, "gate_up_rows": rows1, "huge_pages": args.huge_pages,
                       "spin_us": args.spin_us, "time_us": where, "paired": pairs}
                rows.append(row)
                print(f"{fmt:>9} threads={ex.threads:<3} isa={ex.isa:<12} T={T} "
                      f"prefetch={ahead} down={split} rows1={rows1} "
                      f"huge={int(args.huge_pages)}: "
                      f"{gbps:6.2f} GB/s of {ceiling:6.2f} ceiling ({gbps / ceiling:5.1%}), "
                      f"{us:8.1f} us/call", flush=True)
                if pairs:
                    print(f"    paired with sustained stream reads: {pairs['ratio_median']:.1%} "
                          f"by wall time, {pairs['pool_ratio_median']:.1%} by the pool's time "
                          f"(medians of {args.pairs})", flush=True)
                if args.timing:
                    print("    " + " ".join(f"{k}={v}" for k, v in where.items()), flush=True)
            ex.close()
        del stacks
    host = socket.gethostname()
    result = {
        "bench": "cpu_moe", "git": git_state(os.environ.get("GIT_SHA")), "host": host,
        "cpu": cpu_model(),
        "usable_cores": len(cx.usable_cores()), "l3_bytes": l3, "working_set_bytes": ws,
        "ceiling_buffer_bytes": buf.numel(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "params": vars(args), "settings": machine()["settings"], "results": rows,
    }
    print(f"wrote {save_result(Path(args.out), f'cpu_moe-{host}', result)}")


if __name__ == "__main__":
    main()
