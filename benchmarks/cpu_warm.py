"""What a warm read saves a CPU job: one MoE layer's job on experts just read into the caches
(``CpuMoeExecutor.warm``, waited for to its end) against the same job on experts evicted by a
read of a buffer several times the last-level cache. The ceiling of what the cpu strategy's warm
reads can save on a GPU machine, where they run while the GPU computes; on a box without a GPU
nothing overlaps, so this times the mechanism only.

    python benchmarks/cpu_warm.py --threads 2 --experts 8 --reps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.cpu import executor as cx  # noqa: E402
from freetoken.quant import get_format  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fmt", default="q8_0")
    p.add_argument("--shape", default="128x2048x768", help="experts x hidden x intermediate "
                   "(default: Qwen3-30B-A3B's)")
    p.add_argument("--experts", type=int, default=8, help="experts per job (top-k, one token)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--evict-mb", type=int, default=1024, help="buffer read to evict the caches")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    E, H, I_ = (int(v) for v in args.shape.split("x"))
    q = get_format(args.fmt)
    g = torch.Generator().manual_seed(0)

    def stack(rows: int, cols: int) -> cx.ExpertStack:
        w = torch.randn(E, rows, cols, generator=g) / cols**0.5
        return cx.ExpertStack.from_quant(q.quantize(w), copy=True)

    ex = cx.CpuMoeExecutor(threads=args.threads)
    ex.add_layer(0, stack(I_, H), stack(I_, H), stack(H, I_))
    evict = torch.ones(args.evict_mb << 18)  # float32: MB * 2**20 / 4
    x = torch.randn(1, H)
    w = torch.full((1, args.experts), 1.0 / args.experts)

    def job(ids: torch.Tensor) -> float:
        t = time.perf_counter()
        ex.run(x, ids, w, 0)
        return time.perf_counter() - t

    cold, warm, warm_read = [], [], []
    for _ in range(args.reps):
        for kind in ("cold", "warm"):
            ids = torch.randperm(E, generator=g)[:args.experts].view(1, -1)
            evict.add_(1.0)  # read and written: the experts leave the caches
            if kind == "warm":
                _, before = ex.warm_stats()
                t = time.perf_counter()
                assert ex.warm(0, ids.view(-1).to(torch.int32))
                want = None
                while (got := ex.warm_stats()[1] - before) != want:  # until the read ends
                    want = got
                    time.sleep(0.001)
                warm_read.append(time.perf_counter() - t - 0.001)
            (warm if kind == "warm" else cold).append(job(ids))
    cold_us, warm_us = 1e6 * statistics.median(cold), 1e6 * statistics.median(warm)
    nbytes = ex.warm_stats()[1] / args.reps
    print(f"{args.experts} experts of {args.fmt} {args.shape}, {args.threads} threads: job "
          f"{cold_us:.0f} us cold, {warm_us:.0f} us warmed ({cold_us / warm_us:.2f}x); the "
          f"warm read {nbytes / 2**20:.1f} MB in about {1e6 * statistics.median(warm_read):.0f}"
          " us")
    result = {"git": git_state(args.git_sha), **host(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "params": {k: str(v) for k, v in vars(args).items()}, "isa": ex.isa,
              "job_us_cold": cold_us, "job_us_warmed": warm_us, "speedup": cold_us / warm_us,
              "warm_read_mb": nbytes / 2**20,
              "warm_read_us": 1e6 * statistics.median(warm_read)}
    stem = "cpu_warm" + (f"-{args.label}" if args.label else "")
    print(f"wrote {save_result(args.out, stem, result)}")


if __name__ == "__main__":
    main()
