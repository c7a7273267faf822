"""What a kernel boundary costs inside a CUDA graph, and what programmatic dependent launch
(PDL: a kernel let start while the one before it finishes, waiting in the kernel for its
results) takes off it. A chain of N matrix-vector kernels, each reading the one before's
output (y = W_i @ x, W_i 2048 x 2048 bf16 or smaller), captured in one graph and replayed:
plain launches; PDL with the wait first; PDL with the kernel's first weight tile read before
the wait. The outputs of the three must be the same bits.

    python benchmarks/launch_chain.py --kernels 96 --rows 2048 --cols 2048
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402


@triton.jit
def _gemv(w_ptr, x_ptr, y_ptr, R, K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, EARLY: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    cols = tl.arange(0, BLOCK_K)
    w0 = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    if EARLY:  # the first tile of the weights, which no kernel before writes, before the wait
        w0 = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=ok[:, None],
                     other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EARLY and k0 == 0:
            w = w0
        else:
            w = tl.load(w_ptr + rows[:, None] * K + (k0 + cols)[None, :], mask=ok[:, None],
                        other=0.0).to(tl.float32)
        x = tl.load(x_ptr + k0 + cols).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=ok)


def chain(ws: list[torch.Tensor], xs: list[torch.Tensor], mode: str, block_r: int,
          block_k: int, warps: int) -> None:
    """Each kernel reads the one before's output (xs[i] -> xs[i + 1])."""
    for i, w in enumerate(ws):
        R, K = w.shape
        extra = {"launch_pdl": True} if mode != "plain" else {}
        _gemv[(triton.cdiv(R, block_r),)](w, xs[i], xs[i + 1], R, K=K, BLOCK_R=block_r,
                                          BLOCK_K=block_k, PDL=mode != "plain",
                                          EARLY=mode == "early", num_warps=warps, **extra)


def timed(fn, reps: int) -> float:
    """Microseconds a replay of fn's graph takes, median of ``reps``."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernels", type=int, default=96)
    p.add_argument("--shapes", default="2048x2048,512x2048,5120x2048",
                   help="rows x cols of each chain's matrices (cols = the x it reads)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--label", default="gpu")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--git-sha", default="")
    args = p.parse_args()
    rows_out = []
    for shape in args.shapes.split(","):
        R, K = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        # a square chain feeds each output on; a non-square one reads a fixed x each kernel
        # but writes where the next reads, so the order between kernels still matters
        ws = [torch.randn(R, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
              for _ in range(args.kernels)]
        n = max(R, K)
        xs = [torch.randn(n, device="cuda", dtype=torch.bfloat16)
              for _ in range(args.kernels + 1)]
        outs, times = {}, {}
        for mode in ("plain", "pdl", "early"):
            for x in xs[1:]:
                x.zero_()
            times[mode] = timed(functools.partial(chain, ws, xs, mode, 4, 256, 4), args.reps)
            outs[mode] = torch.stack([x[:R].clone() for x in xs[1:]])
        same = all(torch.equal(outs["plain"], outs[m]) for m in ("pdl", "early"))
        row = {"shape": shape, "kernels": args.kernels, "bytes_per_kernel": R * K * 2,
               "us": times, "us_per_kernel": {m: t / args.kernels for m, t in times.items()},
               "same_bits": same}
        print(row, flush=True)
        rows_out.append(row)
    result = {"bench": "launch_chain", "label": args.label, **git_state(args.git_sha), **host(),
              "gpu": torch.cuda.get_device_name(), "triton": triton.__version__,
              "params": vars(args), "rows": rows_out}
    print(save_result(Path(args.out), f"launch_chain-{args.label}", result))


if __name__ == "__main__":
    main()
