"""The critical path of an offloaded decode step in pieces, layer by layer: when each piece was
launched, when the GPU reached each host step (a CUDA event recorded before it, mapped onto the
host's clock), when the host saw the routed ids, planned, launched the GPU's share, saw the
CPU's result and launched the next layer's attention. Averaged over layers and steps, the
segments say where a layer's period goes:

- ``gpu_attention``: the GPU from the later of (the result's launch, its own share done) to
  the next layer's routed ids (the CPU's result added, attention, router, look-ahead's picks);
- ``ids_to_host``: the GPU's ids made -> the host past its sync (``host_late``: the host came to
  its wait after that, by this much; ``copy_in_prepare``: the host step up to its wait);
- ``before_plan``: the host's sync -> the library's plan called (Python);
- ``plan``: the library's call (the CPU's job submitted a few us in, then the copies);
- ``plan_to_launch``: the library's return -> the GPU's share launched;
- ``cpu_job``: the plan's call -> the pool's job done (``future.seconds`` from its submit);
- ``job_to_host``: the job done -> the engine thread past its wait;
- ``wait_to_launch``: past its wait -> the next piece launched (``land``: the result's copy);
- ``gpu_share``: the GPU's share launched -> done on the GPU (the copies it waits for, the
  kernels), and ``gpu_late``: how often the GPU's share, not the CPU's, ended last.

    python benchmarks/step_timeline.py --model M.gguf --strategy hybrid --online --tokens 48

Wrappers around the engine's methods (the events cost a few microseconds of host time a
layer); the job's submit is taken as its plan's start (routing and the split come first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from benchmarks.plan_profile import sampling  # noqa: E402
from freetoken.config import CacheSizing, EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine  # noqa: E402
from freetoken.engine.resolve import parse_bytes  # noqa: E402

Record = list[tuple[Any, ...]]


class Timeline:
    """What the wrappers saw in one decode step: ("launch", t0, t1), ("host", t_in, t_wait,
    t_sync, t_call0, t_call1, n_cpu, n_fetched, n_ahead, t_out, gpu_at), ("late", t_in,
    t_wait0, t_wait1, job_us, land_us, t_out, gpu_at); times in microseconds on the host's
    clock, gpu_at a CUDA event until the step ends (then microseconds on the host's clock)."""

    def __init__(self) -> None:
        import torch
        self.wait_us = self.land_us = 0.0
        self.torch = torch
        self.on = False
        self.steps: list[Record] = []
        self.now: Record = []
        self.ref = None
        self.ref_us = 0.0
        self.call: tuple[float, float, int, int, int] | None = None
        self.sync_us = 0.0
        self.job: tuple[float, float, float] | None = None

    @staticmethod
    def us() -> float:
        return time.perf_counter_ns() / 1e3

    def event(self) -> Any:
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def begin(self) -> None:
        """A step starts on an idle GPU: an event the host waits for is the clocks' anchor."""
        self.now = []
        self.ref = self.event()
        self.ref.synchronize()
        self.ref_us = self.us()

    def end(self) -> None:
        """The step's events read, once its work is done."""
        self.torch.cuda.synchronize()
        out: Record = []
        for r in self.now:
            if r[0] in ("host", "late"):
                r = (*r[:-1], self.ref_us + 1e3 * self.ref.elapsed_time(r[-1]))
            out.append(r)
        self.steps.append(out)


def instrument(tl: Timeline) -> None:
    """Wrap the decode step's parts so that :attr:`Timeline.now` collects a step's times."""
    from freetoken.cpu.jobs import CpuMoeFuture
    from freetoken.engine import graph
    from freetoken.moe.host_steps import HostStep, LateStep
    from freetoken.moe.layer_call import LayerCall

    run, launch = graph.DecodeGraphs.run, graph.Launches.__call__
    host_run, host_wait, late_run = HostStep.run, HostStep._wait, LateStep.run
    land = LateStep.land
    call_run, wait = LayerCall.run, CpuMoeFuture.wait

    def step(self: Any, tokens: Any, segments: Any) -> Any:
        if not tl.on:
            return run(self, tokens, segments)
        tl.begin()
        out = run(self, tokens, segments)
        tl.end()
        return out

    def launched(self: Any) -> None:
        t0 = tl.us()
        launch(self)
        if tl.on:
            tl.now.append(("launch", t0, tl.us()))

    def planned(self: Any, n: int, go: Any = None) -> bool:
        if not tl.on:
            return host_run(self, n, go)
        gpu_at, t_in, at = tl.event(), tl.us(), len(tl.now)
        tl.call, tl.sync_us, tl.wait_us = None, 0.0, 0.0
        tl.now.append(("busy",))  # ahead of the launches made inside
        early = host_run(self, n, go)
        c = tl.call or (0.0, 0.0, 0, 0, 0)
        tl.now[at] = ("host", t_in, tl.wait_us, tl.sync_us, *c, tl.us(), gpu_at)
        return early

    def synced(self: Any) -> None:
        tl.wait_us = tl.us()
        host_wait(self)
        tl.sync_us = tl.us()

    def called(self: Any) -> int:
        t0 = tl.us()
        code = call_run(self)
        c = self.c
        tl.call = (t0, tl.us(), c.n_cpu, c.n_fetched, c.ahead.n_fetched if code == 0 else 0)
        return code

    def late(self: Any, n: int) -> None:
        if not tl.on:
            return late_run(self, n)
        gpu_at, t_in, at = tl.event(), tl.us(), len(tl.now)
        tl.job, tl.land_us = None, 0.0
        tl.now.append(("busy",))
        late_run(self, n)
        j = tl.job or (0.0, 0.0, 0.0)
        tl.now[at] = ("late", t_in, *j, tl.land_us, tl.us(), gpu_at)
        return None

    def landed(self: Any, extra: Any, n: int) -> None:
        t0 = tl.us()
        land(self, extra, n)
        tl.land_us = tl.us() - t0

    def waited(self: Any) -> Any:
        t0 = tl.us()
        out = wait(self)
        tl.job = (t0, tl.us(), 1e6 * self.seconds)
        return out

    graph.DecodeGraphs.run = step
    graph.Launches.__call__ = launched
    HostStep.run, HostStep._wait, LateStep.run, LateStep.land = planned, synced, late, landed
    LayerCall.run, CpuMoeFuture.wait = called, waited


def layers_of(rec: Record) -> list[dict[str, float]]:
    """One row per layer whose plan left a CPU share: its host step, the piece launched in it
    (the GPU's share), its late step and the piece launched after it (the next attention)."""
    rows: list[dict[str, float]] = []
    for i, r in enumerate(rec):
        if r[0] != "host":
            continue
        _, t_in, t_wait, t_sync, c0, c1, n_cpu, n_fetch, n_ahead, t_out, gpu_ids = r
        share = next((x for x in rec[i + 1:] if x[0] == "launch"), None)
        j = next((k for k in range(i + 1, len(rec)) if rec[k][0] in ("late", "host")), None)
        if j is None or rec[j][0] != "late" or share is None or not n_cpu:
            continue
        _, l_in, w0, w1, job_us, land_us, l_out, gpu_share = rec[j]
        after = next((x for x in rec[j + 1:] if x[0] == "launch"), None)
        ids_next = next((x for x in rec[j + 1:] if x[0] == "host"), None)
        row = {"before_plan": c0 - t_sync, "plan": c1 - c0, "plan_to_launch": share[1] - c1,
               "launch": share[2] - share[1], "cpu_job": job_us,
               "job_to_host": w1 - (c0 + job_us), "gpu_share": gpu_share - share[1],
               "wait_before_job_end": c0 + job_us - w0, "host_step": t_out - t_in,
               "late_step": l_out - l_in,
               "n_cpu": n_cpu, "n_fetched": n_fetch, "n_ahead": n_ahead,
               "ids_to_host": t_sync - gpu_ids, "host_late": t_wait - gpu_ids,
               "copy_in_prepare": t_wait - t_in, "land": land_us}
        if after is not None:
            row["wait_to_launch"] = after[1] - w1
            row["gpu_late"] = float(gpu_share > after[1])
            if ids_next is not None:
                row["gpu_attention"] = ids_next[-1] - max(after[2], gpu_share)
                row["period"] = ids_next[3] - t_sync
        rows.append(row)
    return rows


def summarise(steps: list[Record]) -> dict[str, Any]:
    """Medians and means of each segment over every layer row of every step (the first and last
    rows of a step left out: the step's start and its head differ)."""
    rows = [r for rec in steps for r in layers_of(rec)[1:-1]]
    keys = sorted({k for r in rows for k in r})
    out: dict[str, Any] = {"layer_rows": len(rows)}
    for k in keys:
        vals = [r[k] for r in rows if k in r]
        out[k] = {"median": statistics.median(vals), "mean": statistics.fmean(vals)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", default="hybrid")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--moe-cpu-threads", type=int, default=None)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16",
                       moe_strategy=args.strategy, max_seq_len=args.tokens + 256,
                       cuda_graph_max_bs=16, moe_cpu_threads=args.moe_cpu_threads,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)),
                       moe_hybrid_online=args.online)
    engine = Engine(cfg)
    ids = engine.encode("The history of computing")
    engine.generate(ids, sampling(args, 16))
    tl = Timeline()
    instrument(tl)
    t0 = time.perf_counter()
    engine.generate(ids, sampling(args))
    plain_s = time.perf_counter() - t0
    tl.on = True
    t0 = time.perf_counter()
    engine.generate(ids, sampling(args))
    wall = time.perf_counter() - t0
    result = {"bench": "step_timeline", **git_state(args.git_sha), **host(),
              "params": vars(args) | {"out": str(args.out)},
              "tokens_per_s": args.tokens / wall, "tokens_per_s_plain": args.tokens / plain_s,
              "steps": len(tl.steps), "segments_us": summarise(tl.steps),
              "first_step": tl.steps[len(tl.steps) // 2] if tl.steps else []}
    print(json.dumps({k: v for k, v in result.items() if k != "first_step"}, indent=1))
    label = f"-{args.label}" if args.label else ""
    save_result(args.out, f"step_timeline-{Path(args.model).stem}-{args.strategy}{label}",
                result)


if __name__ == "__main__":
    main()
