"""Where the host's time goes in offload and hybrid decode: each step of a layer's plan timed
on the host (perf_counter around the methods), averaged per layer call.

    python benchmarks/plan_profile.py --model M.gguf --strategy hybrid --tokens 48
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import CacheSizing, EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402
from freetoken.resolve import parse_bytes  # noqa: E402

TOTALS: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def timed(owner: Any, name: str, label: str) -> None:
    """Wrap ``owner.name`` so its host time adds up under ``label``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            slot = TOTALS[label]
            slot[0] += time.perf_counter() - t0
            slot[1] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", default="hybrid")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    from freetoken.engine.graph import HostStep
    from freetoken.moe import cpu_executor as cx
    from freetoken.moe.expert_cache import SlotPool
    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.offload import OffloadExperts, OffloadRuntime

    cfg = EngineConfig(model=args.model, device=args.device, dtype="bfloat16",
                       moe_strategy=args.strategy, max_seq_len=args.tokens + 256,
                       cuda_graph_max_bs=16 if args.device == "cuda" else 0,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)),
                       moe_hybrid_online=args.online)
    engine = Engine(cfg)
    ids = engine.encode("The history of computing")
    engine.generate(ids, SamplingParams(max_tokens=8, ignore_eos=True))
    cls = HybridExperts if args.strategy == "hybrid" else OffloadExperts
    # (_plan itself is held by the captured graphs as a bound method: time what it calls)
    for name in ("_plan_misses", "_route", "_fetch", "_split", "_submit", "_collect", "_record",
                 "_observe_last"):
        if hasattr(cls, name):
            timed(cls, name, f"{cls.__name__}.{name}")
    timed(HostStep, "run", "HostStep.run (whole break)")
    timed(SlotPool, "publish", "SlotPool.publish")
    timed(SlotPool, "admit", "SlotPool.admit")
    timed(OffloadRuntime, "copy", "OffloadRuntime.copy")
    timed(cx.CpuMoeExecutor, "submit", "CpuMoeExecutor.submit")
    timed(cx.CpuMoeFuture, "wait", "CpuMoeFuture.wait")
    TOTALS.clear()
    t0 = time.perf_counter()
    engine.generate(ids, SamplingParams(max_tokens=args.tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    rows = {k: {"us_per_call": 1e6 * s / n, "calls": n, "share_of_wall": s / wall}
            for k, (s, n) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0])}
    result = {"bench": "plan_profile", **git_state(args.git_sha), **host(),
              "params": vars(args) | {"out": str(args.out)}, "wall_s": wall,
              "tokens_per_s": args.tokens / wall, "steps": rows}
    print(json.dumps(result, indent=1))
    save_result(args.out, f"plan_profile-{Path(args.model).stem}-{args.strategy}", result)


if __name__ == "__main__":
    main()
