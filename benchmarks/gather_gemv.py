"""Decode's expert compute on the GPU per weight format: the fused gather-GEMV kernels against
their slow twin (gather, dequantise, batched matmul), next to a device copy of the same weight
bytes measured in the same run (the HBM ceiling for reading them).

One call = one MoE layer's pairs (--pairs, distinct experts) of gate/up/down read from a pool of
--slots expert slots, laid out as the expert cache holds them (the engine's bank rows: gate's
and up's blocks one stack where they follow each other, nvfp4's scales beside its codes).
Each call is timed eagerly and inside a CUDA graph of 20 calls (as decode runs it: no launch
overhead). Successive calls read the next of the --slots // --pairs disjoint sets of slots, so
a call's weights are not in the GPU's L2 (a layer's 40 MB fit there), as decode's layers find
them; --hot reads the same pairs every call, as the sweeps before 2026-12-07 did.
``--sweep`` times the fused call in a graph for every output-rows / blocks-per-step / warps
choice of its kernels and reports the fastest (the values ``kernels/gemv_launch.py:KERNELS``
should carry). Its figures in docs/benchmarks.md up to
2026-12-06 timed the projections as separate stacks (gate and up in two launches).

    python benchmarks/gather_gemv.py --formats q8_0,q4_k/q6_k,q5_0/q8_0 --shape 2048x768
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.kernels import gemv_launch  # noqa: E402
from freetoken.kernels.gather_gemv import gathered_fused, gathered_reference  # noqa: E402
from freetoken.moe.host_banks import PROJECTIONS, BankBuilder  # noqa: E402
from freetoken.quant import QuantTensor, get_format  # noqa: E402


def seconds_per_call(fn: Any, reps: int) -> float:
    """One call's time, ``fn(i)`` called for i in range(reps) (a call may rotate its inputs by
    i)."""
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(reps):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def graph_seconds_per_call(fn: Any, calls: int = 20, replays: int = 20) -> float:
    """One call's time inside a CUDA graph of ``calls`` calls (``fn(i)``), replayed
    ``replays`` times."""
    fn(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    return seconds_per_call(lambda _: g.replay(), replays) / calls


SWEEP = {"rows": (1, 2, 4, 8, 16, 32), "step": (8, 16, 32), "warps": (1, 2, 4),
         "bits": (False, True)}
# q8_0x8's readers, as (sums, int8_x): the float one, block sums, int8 x (--readers picks)
READERS = {"float": (False, False), "sums": (True, False), "int8_x": (False, True)}
BITS_FORMATS = {"q8_0", "q8_0x8", "mxfp4", "nvfp4"}  # kernels with a bits choice
SUMS_FORMATS = {"q8_0x8"}  # kernels with sums and int8_x choices


def sweep(formats: tuple[str, str, str], call: Any, budget_s: float = 0,
          readers: tuple[str, ...] = tuple(READERS)) -> list[dict[str, Any]]:
    """The fused call in a graph for every kernel choice (the same for the formats of this
    layer; ``step`` only where a kernel loops over several blocks), for at most ``budget_s``
    seconds where it is set (the choices timed by then)."""
    t_end = time.perf_counter() + budget_s if budget_s else float("inf")
    saved = dict(gemv_launch.KERNELS)
    looped = any(saved[f].step > 1 for f in formats)
    grid = SWEEP
    bits = grid["bits"] if BITS_FORMATS & set(formats) else (False,)
    read = [READERS[r] for r in readers] if SUMS_FORMATS & set(formats) else [(False, False)]
    rows = []
    try:
        choices = [(r, st, w, b, sm, ix) for r, st, w, b, (sm, ix) in itertools.product(
            grid["rows"], grid["step"] if looped else (1,), grid["warps"], bits, read)]
        random.Random(0).shuffle(choices)  # a budget's cut leaves a spread of the choices
        now = saved[formats[0]]
        today = (now.rows, now.step, now.warps, now.bits, now.sums, now.int8_x)
        if today in choices:  # today's first
            choices.remove(today)
            choices.insert(0, today)
        for r, st, w, b, sm, ix in choices:
            if time.perf_counter() > t_end:
                print(f"  sweep stopped at its budget of {budget_s:.0f} s", flush=True)
                break
            for f in set(formats):
                gemv_launch.KERNELS[f] = dataclasses.replace(
                    saved[f], rows=r, warps=w, step=st if saved[f].step > 1 else 1, bits=b,
                    sums=sm and f in SUMS_FORMATS, int8_x=ix and f in SUMS_FORMATS)
            try:
                us = graph_seconds_per_call(call) * 1e6
            except Exception as e:  # noqa: BLE001 - a choice that does not compile is skipped
                print(f"  rows {r} step {st} warps {w} bits {b:d} sums {sm:d} int8_x {ix:d}: "
                      f"{type(e).__name__}", flush=True)
                continue
            rows.append({"rows": r, "step": st, "warps": w, "bits": b, "sums": sm,
                         "int8_x": ix, "graph_us": us})
    finally:
        gemv_launch.KERNELS.update(saved)
    return sorted(rows, key=lambda d: d["graph_us"])


def slot_stacks(formats: tuple[str, str, str], H: int, I_: int, slots: int,
                device: str = "cuda") -> tuple[list[QuantTensor], int]:
    """``slots`` copies of one random expert laid out as the expert cache holds them (the
    engine's own bank rows: gate, up and down with their scales, where a format keeps them
    apart), each projection's (slots, rows, cols) view, and the bytes of one expert."""
    g = torch.Generator().manual_seed(0)
    builder = BankBuilder(0, slots, H, I_)
    one = [get_format(f).quantize(torch.randn(*builder.want(p), generator=g) * 0.02)
           for f, p in zip(formats, PROJECTIONS, strict=True)]
    for e in range(slots):
        for p, q in zip(PROJECTIONS, one, strict=True):
            builder.add(p, q, e)
    bank = builder.build(pinned=False, device=torch.device(device))
    return [bank.layout.quant(bank.rows, p) for p in PROJECTIONS], bank.expert_bytes


def measure(formats: tuple[str, str, str], H: int, I_: int, slots: int, pairs: int,
            reps: int, do_sweep: bool = False, budget_s: float = 0,
            cold: bool = True, readers: tuple[str, ...] = tuple(READERS)) -> dict[str, Any]:
    stacks, expert_bytes = slot_stacks(formats, H, I_, slots)
    x = torch.randn(1, H, dtype=torch.bfloat16, device="cuda")
    w = torch.rand(1, pairs, device="cuda")
    # hot: the same pairs every call (their weights stay in the GPU's L2, which holds a
    # layer's 40 MB); cold: each call the next of the disjoint sets the slots make, as decode's
    # layers read experts the L2 has not kept
    sets = torch.randperm(slots)[: slots // pairs * pairs].view(-1, pairs).cuda()
    if not cold:
        sets = sets[:1]
    act = torch.nn.functional.silu
    nbytes = pairs * expert_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda _: dst.copy_(src), reps)

    def fused(i: int) -> Any:
        return gathered_fused(x, w, sets[i % len(sets)], *stacks, act)

    def slow(i: int) -> Any:
        return gathered_reference(x, w, sets[i % len(sets)], *stacks, act)

    fused_s = seconds_per_call(fused, reps)
    slow_s = seconds_per_call(slow, reps)
    fused_graph_s = graph_seconds_per_call(fused)
    slow_graph_s = graph_seconds_per_call(slow)
    tried = sweep(formats, fused, budget_s, readers) if do_sweep else []
    # a copy reads and writes each byte: reading alone runs at about twice its byte rate
    ceiling = 2 * nbytes / copy_s
    return {"formats": "/".join(formats), "hidden": H, "intermediate": I_, "pairs": pairs,
            "cold": cold, "index_sets": len(sets),
            "weight_bytes": nbytes, "fused_us": fused_s * 1e6, "dequant_matmul_us": slow_s * 1e6,
            "speedup": slow_s / fused_s, "fused_gbps": nbytes / fused_s / 1e9,
            "read_ceiling_gbps": ceiling / 1e9, "fraction_of_ceiling": nbytes / fused_s / ceiling,
            "graph": {"fused_us": fused_graph_s * 1e6, "dequant_matmul_us": slow_graph_s * 1e6,
                      "fused_gbps": nbytes / fused_graph_s / 1e9,
                      "fraction_of_ceiling": nbytes / fused_graph_s / ceiling},
            "kernels": {f: dataclasses.asdict(gemv_launch.KERNELS[f]) for f in set(formats)},
            "sweep": tried}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="q8_0,q4_k/q4_k/q6_k,q5_0/q5_0/q8_0",
                   help="comma-separated gate/up/down formats (one name: all three)")
    p.add_argument("--shape", default="2048x768", help="hidden x moe intermediate")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--sweep", action="store_true",
                   help="time every kernel choice of rows, step and warps in a graph")
    p.add_argument("--sweep-budget-s", type=float, default=0,
                   help="stop the sweep after this many seconds (0: every choice)")
    p.add_argument("--readers", default=",".join(READERS),
                   help="q8_0x8's readers the sweep tries, comma-separated of "
                        f"{', '.join(READERS)}")
    p.add_argument("--hot", action="store_true",
                   help="the same pairs every call (their weights stay in the L2); default: "
                        "each call the next disjoint set of --slots // --pairs, as in decode")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    readers = tuple(args.readers.split(","))
    if not set(readers) <= set(READERS):
        p.error(f"--readers {args.readers!r}: choose from {', '.join(READERS)}")
    if args.sweep and os.environ.get("FREETOKEN_GEMV_LAUNCH"):
        p.error("FREETOKEN_GEMV_LAUNCH is set: its choices would replace every one the sweep "
                "tries; unset it for --sweep")
    if args.slots < args.pairs:
        p.error(f"--slots {args.slots} holds fewer experts than --pairs {args.pairs}")
    H, I_ = (int(v) for v in args.shape.split("x"))
    rows = []
    for spec in args.formats.split(","):
        names = spec.split("/") * 3 if "/" not in spec else spec.split("/")
        if len(names) != 3:
            p.error(f"--formats entry {spec!r}: give one format or gate/up/down")
        rows.append(measure((names[0], names[1], names[2]), H, I_, args.slots, args.pairs,
                            args.reps, args.sweep, args.sweep_budget_s, not args.hot,
                            readers))
        r, gr = rows[-1], rows[-1]["graph"]
        print(f"{r['formats']:>16} {H}x{I_}: fused {r['fused_us']:7.1f} us eager, "
              f"{gr['fused_us']:7.1f} us in a graph ({gr['fused_gbps']:6.0f} GB/s, "
              f"{100 * gr['fraction_of_ceiling']:4.1f} % of the read ceiling); dequantise + "
              f"matmul {r['dequant_matmul_us']:7.1f} / {gr['dequant_matmul_us']:7.1f} us",
              flush=True)
        for t in r["sweep"][:5]:
            print(f"    rows {t['rows']:2d} step {t['step']:2d} warps {t['warps']} "
                  f"bits {t['bits']:d} sums {t['sums']:d} int8_x {t['int8_x']:d}: "
                  f"{t['graph_us']:7.1f} us ({r['weight_bytes'] / t['graph_us'] / 1e3:5.0f} GB/s)",
                  flush=True)
        if r["sweep"]:
            best = r["sweep"][0]
            r["launch"] = " ".join(
                f"{f}={best['rows']},{best['step']},{best['warps']}"
                + (f",{best['bits']:d}" if f in BITS_FORMATS else "")
                + (f",{best['sums']:d},{best['int8_x']:d}" if f in SUMS_FORMATS else "")
                for f in sorted(set(r["formats"].split("/"))))
            print(f"    FREETOKEN_GEMV_LAUNCH='{r['launch']}'", flush=True)
    result = {"bench": "gather_gemv", "label": args.label, **git_state(args.git_sha), **host(),
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
              "params": vars(args) | {"out": str(args.out)}, "rows": rows}
    save_result(args.out, f"gather_gemv-{args.label or args.shape}", result)


if __name__ == "__main__":
    main()
