"""Where the host's time goes in offload and hybrid decode: each step of a layer's plan timed
on the host (perf_counter around the methods), averaged per layer call. With ``--trace``, a
second run under torch.profiler: how long the GPU is busy (kernels and copies, per stream and
all together) against the wall, and the host's time in CUDA runtime calls (graph launches,
syncs, copies); the Chrome trace is saved next to the JSON (gzip).

    python benchmarks/plan_profile.py --model M.gguf --strategy hybrid --tokens 48 --trace
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import CacheSizing, EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine  # noqa: E402
from freetoken.engine.resolve import parse_bytes  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402

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


def sampling(args: argparse.Namespace, tokens: int | None = None) -> SamplingParams:
    """The run's sampling: ``tokens`` (default ``--tokens``) at ``--temperature``, seeded."""
    return SamplingParams(max_tokens=tokens or args.tokens, ignore_eos=True,
                          temperature=args.temperature, seed=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", default="hybrid")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (0: greedy; 1: what chat clients send)")
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--hold", choices=("fetch", "split", "cpu"),
                   help="hybrid: the wall check held at this arm from the start (implies "
                   "--online): fetch times a hybrid whose split has gone all-fetch")
    p.add_argument("--trace", action="store_true", help="also a torch.profiler run: GPU busy "
                   "time against the wall, CUDA runtime calls; the trace saved (gzip)")
    p.add_argument("--cprofile", action="store_true", help="also a run under cProfile: the "
                   "Python functions that take the host's time (own time, per token)")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from freetoken.cpu import executor as cx
    from freetoken.moe.host_steps import HostStep, LateStep
    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.offload import OffloadExperts, OffloadRuntime
    from freetoken.moe.slot_pool import SlotPool

    cfg = EngineConfig(model=args.model, device=args.device, dtype="bfloat16",
                       moe_strategy=args.strategy, max_seq_len=args.tokens + 256,
                       cuda_graph_max_bs=16 if args.device == "cuda" else 0,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)),
                       moe_hybrid_online=args.online or args.hold is not None)
    engine = Engine(cfg)
    if args.hold is not None:
        for m in engine.model.modules():
            check = m.policy.costs.check if isinstance(m, HybridExperts) else None
            if check is not None:
                check.hold(args.hold)
    ids = engine.encode("The history of computing")
    engine.generate(ids, sampling(args, 8))
    cls = HybridExperts if args.strategy == "hybrid" else OffloadExperts
    # (_plan and _finish are held by the captured graphs as bound methods: time what they
    # call)
    for name in ("_plan_misses", "_route", "_fetch", "_split", "_submit", "_collect", "_record",
                 "_observe_last"):
        if hasattr(cls, name):
            timed(cls, name, f"{cls.__name__}.{name}")
    timed(HostStep, "run", "HostStep.run (sync and plan)")
    timed(LateStep, "run", "LateStep.run (CPU wait, no sync)")
    timed(SlotPool, "publish", "SlotPool.publish")
    timed(SlotPool, "admit", "SlotPool.admit")
    timed(OffloadRuntime, "copy", "OffloadRuntime.copy")
    timed(cx.CpuMoeExecutor, "submit", "CpuMoeExecutor.submit")
    timed(cx.CpuMoeFuture, "wait", "CpuMoeFuture.wait")
    TOTALS.clear()
    t0 = time.perf_counter()
    engine.generate(ids, sampling(args))
    wall = time.perf_counter() - t0
    kernels = Counter(m.gpu_kernel for m in engine.model.modules()
                      if isinstance(m, OffloadExperts))
    rows = {k: {"us_per_call": 1e6 * s / n, "calls": n, "share_of_wall": s / wall}
            for k, (s, n) in sorted(TOTALS.items(), key=lambda kv: -kv[1][0])}
    result = {"bench": "plan_profile", **git_state(args.git_sha), **host(),
              "params": vars(args) | {"out": str(args.out)}, "wall_s": wall,
              "tokens_per_s": args.tokens / wall, "steps": rows,
              "gpu_expert_kernels": dict(kernels)}
    if args.trace:
        result["trace"] = traced(engine, ids, args)
    if args.cprofile:
        result["cprofile"] = profiled(engine, ids, args)
    print(json.dumps(result, indent=1))
    hold = f"-{args.hold}" if args.hold else ""
    save_result(args.out, f"plan_profile-{Path(args.model).stem}-{args.strategy}{hold}", result)


def traced(engine: Any, ids: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """A decode run under torch.profiler, summarised from its Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(ids, sampling(args))
    path = args.out / f"trace-{Path(args.model).stem}-{args.strategy}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    with gzip.open(f"{path}.gz", "wt") as f:
        json.dump(events, f)
    path.unlink()
    return summarise_trace(events)


def profiled(engine: Any, ids: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """A decode run under cProfile: the 40 functions with the most own time, per token."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    engine.generate(ids, sampling(args))
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:40]
    return [{"function": f"{Path(f).name}:{line}:{name}", "calls_per_token": n / args.tokens,
             "own_us_per_token": 1e6 * own / args.tokens,
             "total_us_per_token": 1e6 * total / args.tokens}
            for (f, line, name), (_, n, own, total, _) in rows]


def summarise_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """GPU busy time (union of kernel, copy and memset intervals) per stream and overall,
    against the span from the first to the last GPU event; host time per CUDA runtime call."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in
           ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"error": "no GPU events in the trace"}

    def busy(items: list[dict[str, Any]]) -> float:
        total, end = 0.0, float("-inf")
        for e in sorted(items, key=lambda e: e["ts"]):
            start, stop = e["ts"], e["ts"] + e["dur"]
            if stop > end:
                total += stop - max(start, end)
                end = stop
        return total

    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in gpu:
        streams[f"{e.get('tid')}:{e['cat']}"].append(e)
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime":
            slot = runtime[e["name"]]
            slot[0] += e["dur"]
            slot[1] += 1
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        slot = kernels[e["name"][:90]]
        slot[0] += e["dur"]
        slot[1] += 1
    return {
        "gpu_span_us": span,
        "gpu_busy_us": busy(gpu),
        "kernels": {k: {"us_total": t, "calls": n, "share_of_busy": t / busy(gpu)}
                    for k, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]},
        "gpu_busy_share": busy(gpu) / span,
        "busy_share_by_stream": {k: busy(v) / span for k, v in sorted(streams.items())},
        "runtime_calls": {k: {"us_total": t, "calls": n, "share_of_span": t / span}
                          for k, (t, n) in sorted(runtime.items(), key=lambda kv: -kv[1][0])
                          [:12]},
    }


if __name__ == "__main__":
    main()
