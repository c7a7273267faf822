"""The host's time for one decode call's plan of an offloaded layer (offload or hybrid), on the
CPU alone: what every MoE layer of a decode step costs the engine thread between two graph
pieces, apart from the copies and the sync. The row copies are left out (on the CPU they are
memcpys; on a GPU they are queued, not waited for), the hybrid split is held at
``--fetch-fraction`` so the CPU's share is planned every call, look-ahead is off. Each
``--slots`` implementation (the library's decisions, ``native``, or their Python twin) runs in
its own process; the figure is the best of five rounds of ``--calls`` calls per layer, for the
plan and for the late step after the device's share (hybrid: the CPU share collected). With
``--lookahead on`` each layer also prefetches for the next one, from router picks given with
its copies (a decode graph's piece makes them on the device). Strategy ``hybrid-cpuarm`` holds
the wall check's cpu arm instead of a split (every routed pair on the pool, no routing).
``--fetching`` plans as a decode graph made for steps that fetch every miss does (the host
copies hold the ids alone, the call goes through ``_plan_fetching``: hybrid held at all-fetch
with nothing left to collect), the plan offload and hybrid should cost alike.

    python benchmarks/plan_host.py --model q3-4layers.gguf --strategies hybrid,offload
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One process, one strategy and slot implementation: microseconds per layer call."""
    import torch

    from freetoken.config import CacheSizing, EngineConfig
    from freetoken.cpu.row_copy import RowCopier
    from freetoken.engine.engine import Engine
    from freetoken.engine.resolve import parse_bytes
    from freetoken.moe.host_steps import HostCopies
    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.layer_call import LayerCall
    from freetoken.moe.offload import OffloadExperts
    from freetoken.moe.split import SplitPolicy

    cfg = EngineConfig(model=args.model, device="cpu", dtype="bfloat16",
                       moe_strategy=args.strategy.split("-")[0], max_seq_len=256,
                       cuda_graph_max_bs=0,
                       moe_cpu_threads=1, moe_lookahead=args.lookahead,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)))
    engine = Engine(cfg)
    RowCopier.copy = lambda self, *a, **k: None  # type: ignore[method-assign]
    made = LayerCall.__init__

    def without_copies(self: LayerCall, *a: Any, **k: Any) -> None:
        made(self, *a, **k)
        self.c.copy.row_bytes = 0  # the library's plan copies no bytes either
        self.c.ahead.copy.row_bytes = 0

    LayerCall.__init__ = without_copies  # type: ignore[method-assign]
    layers = [m for m in engine.model.modules() if isinstance(m, OffloadExperts)]
    for m in layers:
        check = m.policy.costs.check if isinstance(m, HybridExperts) else None
        if args.strategy == "hybrid-cpuarm" and check is not None:
            check.hold("cpu")
        elif isinstance(m, HybridExperts) and not args.fetching:
            m.policy = SplitPolicy(args.fetch_fraction, None, online=False)
    shape = layers[0].shape
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.host_dtype)  # what the graph piece hands the plan
    host_copies = HostCopies(torch.randn(1, shape.hidden, generator=g).to(dtype),
                             torch.zeros(1, shape.top_k, dtype=torch.long),
                             torch.rand(1, shape.top_k, generator=g).to(dtype),
                             torch.zeros(1, shape.hidden))
    x, ids, w = (t.clone() for t in (host_copies.x, host_copies.ids, host_copies.w))
    if args.fetching:  # the ids alone on the host, as a fetching graph's host step copies
        none = torch.zeros(0, shape.hidden)
        host_copies = HostCopies(none, host_copies.ids, none[:, :shape.top_k], none)
    routes = [torch.randperm(shape.num_experts, generator=g)[:shape.top_k].view(1, -1)
              for _ in range(64)]
    # with look-ahead, each layer's copies bring the next router's picks for one of 64 hidden
    # states (the graph piece before the plan makes them on the device: not the plan's time)
    xs = [torch.randn(1, shape.hidden, generator=g).to(dtype) for _ in range(len(routes))]
    copies = {(m.shape.layer, i): host_copies if m.lookahead is None else dataclasses.replace(
        host_copies, x=host_copies.x if args.fetching else xs[i],
        predicted=m.lookahead.route(xs[i])) for m in layers for i in range(len(routes))}
    method = "_plan_fetching" if args.fetching else "_plan"
    os.sched_setaffinity(0, {0})  # the engine thread's core (the pool's worker has core 1)

    def rounds(n: int) -> float:
        plan = late = 0.0
        for i in range(n):
            for m in layers:
                at = (7 * i + m.shape.layer) % len(routes)
                host_copies.ids.copy_(routes[at])
                if args.prepare and not args.fetching:  # a host step's, before the inputs
                    m._prepare(copies[m.shape.layer, at])
                t0 = time.perf_counter()
                getattr(m, method)(x, ids, w, copies[m.shape.layer, at])
                t1 = time.perf_counter()
                m._finish()
                plan += t1 - t0
                late += time.perf_counter() - t1
        return plan, late

    rounds(50)  # warm-up: the first calls fill the cache and make the CPU jobs
    best, late = min(rounds(args.calls) for _ in range(5))
    return {"strategy": args.strategy, "fetching": args.fetching,
            "prepare": args.prepare, "slots": os.environ.get("FREETOKEN_EXPERT_SLOTS"),
            "layer_call": os.environ.get("FREETOKEN_LAYER_CALL"),
            "pool": type(layers[0].runtime.cache.pool(shape.layer)).__name__,
            "us_per_layer_call": 1e6 * best / (args.calls * len(layers)),
            "late_us_per_layer_call": 1e6 * late / (args.calls * len(layers))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an MoE GGUF (ft synth --layers 4)")
    p.add_argument("--strategies", default="hybrid,offload",
                   help="of hybrid, hybrid-cpuarm, offload")
    p.add_argument("--slots", default="python,native", help="FREETOKEN_EXPERT_SLOTS values")
    p.add_argument("--layer-calls", default="native,python",
                   help="FREETOKEN_LAYER_CALL values, each run with the library's slots")
    p.add_argument("--calls", type=int, default=200, help="calls per layer in each round")
    p.add_argument("--moe-cache-mem", default="500MB")
    p.add_argument("--fetch-fraction", type=float, default=0.5)
    p.add_argument("--lookahead", default="off", choices=["off", "on"],
                   help="--moe-lookahead (on: each layer also predicts and fetches the next "
                   "layer's experts)")
    p.add_argument("--fetching", action="store_true",
                   help="plan as a decode graph for steps that fetch every miss does")
    p.add_argument("--prepare", action="store_true",
                   help="time the plan after its _prepare (what a graph's host step does before "
                   "the inputs arrive, untimed): the part on the critical path")
    p.add_argument("--host-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the dtype of the host copies of x and w (a graph step casts them to "
                   "float32 in the piece; before 2026-12-05 they were the model's bfloat16)")
    p.add_argument("--label", default="")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    p.add_argument("--strategy", default="hybrid", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args)))
        return
    rows = []
    runs = [(slots, call) for slots in args.slots.split(",")
            for call in (args.layer_calls.split(",") if slots == "native" else ["python"])]
    for strategy in args.strategies.split(","):
        for slots, call in runs:
            cmd = [sys.executable, __file__, "--one", "--model", args.model, "--strategy",
                   strategy, "--calls", str(args.calls), "--moe-cache-mem", args.moe_cache_mem,
                   "--fetch-fraction", str(args.fetch_fraction), "--lookahead", args.lookahead,
                   "--host-dtype", args.host_dtype] + ["--fetching"] * args.fetching \
                + ["--prepare"] * args.prepare
            env = os.environ | {"FREETOKEN_EXPERT_SLOTS": slots, "FREETOKEN_LAYER_CALL": call,
                                "FREETOKEN_LOG_LEVEL": "error"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    result = {"bench": "plan_host", **git_state(), **host(),
              "params": vars(args) | {"out": str(args.out)}, "rows": rows}
    save_result(args.out, f"plan_host-{args.label or Path(args.model).stem}", result)


if __name__ == "__main__":
    main()
