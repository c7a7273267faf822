"""Where a prompt's time goes with offloaded experts: per prompt length, the time to the first
token (one untimed prompt of that length first, then the best of ``--repeats``), the expert
stats of the timed prompt (streamed, fetched, hits, fetch and compute seconds), and a
torch.profiler run of one more prompt: the ops with the most device time and the most host
time, so that a prompt whose time does not follow its length shows what it waits on. Each
``--dequant`` way (FREETOKEN_PREFILL_DEQUANT: ``expert``, ``chunk``) is timed at each length
in the same process.

    python benchmarks/prefill_profile.py --model M.gguf --strategy offload --tokens 512,4096 \
        --dequant expert,chunk
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import CacheSizing, EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine, GenerationStats  # noqa: E402
from freetoken.engine.resolve import parse_bytes  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402

STATS = ("calls", "tokens", "hits", "fetched", "streamed", "fetch_s", "compute_s")
TOP = 15  # ops kept per table


def prompt(engine: Engine, n: int) -> list[int]:
    """``n`` random ids, one seed per length (as decode_moe.py's prefill)."""
    return random.Random(n).choices(range(engine.model_config.vocab_size), k=n)


def first_token_s(engine: Engine, ids: list[int]) -> float:
    stats = GenerationStats()
    engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True), stats=stats)
    return stats.prefill_s


def ops(prof: Any, key: str) -> list[dict[str, Any]]:
    """The profiler's ops with the most ``key`` time (self, microseconds), with call counts."""
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:TOP]
    return [{"op": e.key, "calls": e.count, "self_us": round(getattr(e, key), 1)} for e in rows]


def one_length(engine: Engine, n: int, repeats: int, trace: bool) -> dict[str, Any]:
    ids = prompt(engine, n)
    first_token_s(engine, ids)  # untimed: whatever the first prompt of a length sets up
    rt = engine.runner.offload
    best, moe = float("inf"), {}
    for _ in range(repeats):
        before = rt.stats.snapshot(per_layer=False) if rt else {}
        t = first_token_s(engine, ids)
        after = rt.stats.snapshot(per_layer=False) if rt else {}
        if t < best:
            best = t
            moe = {k: after[k] - before[k] for k in STATS if k in after}
    out: dict[str, Any] = {"tokens": n, "first_token_s": best, "tokens_per_s": n / best,
                           "experts": moe}
    if trace:
        acts = [torch.profiler.ProfilerActivity.CPU]
        cuda = torch.cuda.is_available() and engine.runner.device.type == "cuda"
        if cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            t0 = time.perf_counter()
            first_token_s(engine, ids)
            if cuda:
                torch.cuda.synchronize()
            out["profiled_s"] = time.perf_counter() - t0
        out["host_ops"] = ops(prof, "self_cpu_time_total")
        if cuda:
            out["device_ops"] = ops(prof, "self_device_time_total")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", default="offload")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="512,4096", help="prompt lengths, comma separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dequant", default="expert",
                   help="FREETOKEN_PREFILL_DEQUANT ways to time, comma separated (expert, chunk)")
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--moe-cpu-threads", type=int, default=0)
    p.add_argument("--no-trace", action="store_true", help="skip the profiler run")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    lengths = [int(n) for n in args.tokens.split(",") if n]
    cfg = EngineConfig(model=args.model, device=args.device,
                       dtype="bfloat16" if args.device == "cuda" else "float32",
                       moe_strategy=args.strategy, max_seq_len=max(lengths) + 16,
                       cuda_graph_max_bs=16 if args.device == "cuda" else 0,
                       moe_cpu_threads=args.moe_cpu_threads,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)))
    engine = Engine(cfg, progress=False)
    runs = []
    for n in lengths:
        for way in args.dequant.split(","):
            os.environ["FREETOKEN_PREFILL_DEQUANT"] = way
            runs.append({"dequant": way, **one_length(engine, n, args.repeats,
                                                      not args.no_trace)})
            r = runs[-1]
            print(f"{n} tokens, dequant {way}: {r['tokens_per_s']:.1f} tok/s "
                  f"({r['first_token_s']:.2f} s); experts {r['experts']}", flush=True)
            for table in ("device_ops", "host_ops"):
                for row in r.get(table, [])[:6]:
                    print(f"  {table} {row['self_us'] / 1e3:9.1f} ms {row['calls']:6d}x "
                          f"{row['op'][:70]}", flush=True)
    result = {"bench": "prefill_profile", **git_state(args.git_sha), **host(),
              "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "runs": runs}
    stem = f"prefill_profile-{args.label or Path(args.model).stem}-{args.strategy}"
    print(f"saved {save_result(args.out, stem, result)}")


if __name__ == "__main__":
    main()
