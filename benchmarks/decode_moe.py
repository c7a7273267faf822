"""Decode speed per MoE strategy on one checkpoint, next to the link roofline of the run.

For every strategy in --strategies: load the engine, warm up (--warmup-tokens), decode --tokens
tokens (at --temperature, ignoring EOS) --repeats times and keep the best. For strategies with
an expert cache it also records hits, misses, bytes over the link per token and the time spent
fetching and computing experts (the engine's own stats, differenced over the measured run).

PCIe roofline (offload): tokens/s <= gather GB/s / miss bytes per token, where the gather
bandwidth is measured in the same run by the engine's own copy path (bank rows -> device rows,
--gather-experts experts at a time, as one layer's misses arrive).
Hybrid roofline: tokens/s <= (CPU + PCIe GB/s, overlapped) / miss bytes per token (fetched and
CPU-computed misses), the GB/s from the layer kind's row of the bandwidth profile, which the
GPU script writes with `ft bench bw --model` just before.
Serial ceilings (when resident is measured in the same run): a step cannot beat the resident
step plus its link time, since a layer's misses are known only after its router ran on the
GPU: tokens/s <= 1 / (1 / resident tokens/s + miss bytes per token / link GB/s), with the
gather GB/s for offload and the overlapped CPU + PCIe GB/s for hybrid.

Strategies: resident, offload, cpu, hybrid-cap1 (fetch 1 miss per layer step, no correction),
hybrid-profile (the profile's fraction, no correction), hybrid-online (corrected online); all
but cpu decode through CUDA graphs (pieces around host-planned experts), offload-eager without.
A ``+dequant`` suffix (``offload+dequant``) computes cached experts by dequantise + matmul
instead of the fused gather-GEMV kernels; ``+lookahead`` / ``+nolookahead``
(``hybrid-online+lookahead``) set ``--moe-lookahead on`` / ``off`` (default: auto);
``+torchcopy`` copies misses with torch instead of the library (FREETOKEN_ROW_COPY=torch).
For cpu through CUDA graphs it records the share of the wall in the host steps between pieces
and in the pool's jobs within them (the rest: the graph pieces, syncs and sampling).
--prefill-tokens 512,4096 also times one prompt of each length per strategy (random ids, best of
--repeats, after the decode runs): prefill tokens/s, as time to the first token
(--prefill-strategies picks which).

    python benchmarks/decode_moe.py --model M.gguf --strategies resident,offload \
        --moe-cache-mem 4GB --tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from benchmarks.moe_readings import (  # noqa: E402
    fetching_steps,
    hybrid_roofline_gbps,
    moe_delta,
    pool_jobs,
    search_tokens,
    split_costs,
)
from freetoken.config import CacheSizing, EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine, GenerationStats  # noqa: E402
from freetoken.engine.resolve import parse_bytes  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402
from freetoken.moe.cpu import CpuExperts, host_step_totals  # noqa: E402
from freetoken.moe.offload import OffloadExperts, OffloadRuntime  # noqa: E402
from freetoken.moe.resident import ResidentExperts  # noqa: E402
from freetoken.server.process import cpu_pool_part, experts_part  # noqa: E402

VARIANTS = {  # name -> (strategy, --moe-hybrid-max-fetch, --moe-hybrid-online, graphs)
    "offload-eager": ("offload", "auto", True, False),
    "cpu-eager": ("cpu", "auto", True, False),
    "hybrid-cap1": ("hybrid", 1, False, True),
    "hybrid-profile": ("hybrid", "auto", False, True),
    "hybrid-online": ("hybrid", "auto", True, True),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gather_bytes_per_s(engine: Engine, experts: int, seconds: float = 2.0) -> float:
    """The engine's own host -> device copy of ``experts`` random bank rows at a time."""
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, OffloadExperts)]
    rt: OffloadRuntime | None = engine.runner.offload
    assert rt is not None and layers
    sizes = [m.bank.expert_bytes for m in layers if m.bank is not None]
    size = max(set(sizes), key=sizes.count)  # the most common expert size
    layers = [m for m in layers if m.bank is not None and m.bank.expert_bytes == size]
    bank = layers[0].bank
    assert bank is not None
    dst = torch.empty(experts, bank.expert_bytes, dtype=torch.uint8, device=rt.device)
    rng = random.Random(0)
    moved, t_end = 0, time.perf_counter() + seconds
    sync(rt.device)
    t0 = time.perf_counter()
    while time.perf_counter() < t_end:
        m = rng.choice(layers)
        assert m.bank is not None
        picks = rng.sample(range(m.bank.num_experts), experts)
        _, done = rt.copy(dst, list(range(experts)), m.bank, picks)
        rt.wait(done)
        moved += experts * m.bank.expert_bytes
    sync(rt.device)
    return moved / (time.perf_counter() - t0)


def prefill_tokens_per_s(engine: Engine, n: int, repeats: int) -> float:
    """Best of ``repeats`` prompts of ``n`` random ids (one seed per length), as time to the
    first token."""
    vocab = engine.model_config.vocab_size
    ids = random.Random(n).choices(range(vocab), k=n)
    best = 0.0
    for _ in range(repeats):
        stats = GenerationStats()
        engine.generate(ids, SamplingParams(max_tokens=1, ignore_eos=True), stats=stats)
        best = max(best, n / stats.prefill_s)
    return best


def set_env(name: str, values: dict[str, str], options: list[str]) -> None:
    """``name`` set to the value of the last of ``options`` that ``values`` names, else
    unset (the engine's default)."""
    chosen = [values[o] for o in options if o in values]
    if chosen:
        os.environ[name] = chosen[-1]
    else:
        os.environ.pop(name, None)


def run_strategy(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One strategy or variant; ``+dequant`` after the name computes cached experts on the GPU by
    dequantise + matmul (FREETOKEN_GPU_EXPERT_KERNEL=dequant) instead of the fused kernels,
    ``+lookahead`` / ``+nolookahead`` set --moe-lookahead on / off (else auto), ``+torchcopy``
    copies misses with torch (FREETOKEN_ROW_COPY=torch, the library's copies' twin),
    ``+pyslots`` makes the expert cache's decisions in Python (FREETOKEN_EXPERT_SLOTS=python),
    ``+nojoin`` keeps the engine thread out of the CPU pool's jobs while it waits for them,
    ``+hostnode`` holds cpu's jobs in its decode graphs as host nodes instead of breaking them
    at each layer (FREETOKEN_CPU_HOST_NODE=on), ``+flags`` holds them in the graphs served by
    the engine thread on flags (FREETOKEN_CPU_HOST_NODE=flag), and offload's and hybrid's
    plans too (FREETOKEN_HOST_STEPS=flags), ``+pieces`` breaks the graphs at each job and plan
    (FREETOKEN_CPU_HOST_NODE=off, FREETOKEN_HOST_STEPS=pieces; else the engine's defaults),
    ``+early`` launches the next piece once a plan's own device work is queued
    (FREETOKEN_HOST_STEPS=early, the default since a9b9a4b's measure),
    ``+greedy`` decodes at temperature 0
    whatever --temperature says (sampled against greedy in one run), ``+pycall`` plans each
    layer call between graph pieces in Python (FREETOKEN_LAYER_CALL=python: the library's
    one-call plan's twin), ``+regrouped`` / ``+fileblocks`` keep resident Q8_0 experts
    regrouped as Q8_0x8 or as the file's blocks (FREETOKEN_RESIDENT_BLOCKS; else the engine's
    default, regrouped since f51bd7f's measure), ``+denseblocks`` / ``+densedequant`` keep
    Q8_0 dense matrices as blocks on the GPU or dequantise them (FREETOKEN_GPU_DENSE; else the
    engine's default, blocks since f51bd7f), ``+lateflags`` has the
    graph wait for the CPU's results on flags inside its pieces (FREETOKEN_LATE_STEPS=flags;
    else late steps between pieces), ``+pdl`` / ``+nopdl`` launch the GPU's Triton kernels
    to overlap the kernel before or not (FREETOKEN_GPU_PDL=on / off; else the engine's
    default), ``+fusedrouter`` / ``+matmulrouter`` route a decode step with the router's
    matmul in the routing kernel or apart (FREETOKEN_GPU_ROUTER; else the engine's default),
    ``+nocheck`` leaves an
    online split without its wall check (FREETOKEN_WALL_CHECK=off), ``+timing`` times the CPU
    pool's jobs item by item (``pool_jobs``: where a hybrid or cpu job's time went). A greedy
    run (``+greedy``, ``--temperature 0``) of hybrid fetches every miss, as the engine does by
    default (``--moe-hybrid-greedy fetch``); ``+greedysplit`` splits it instead. ``+prefetch75``
    has a hybrid layer fetch 75 % of the next layer's predicted misses while it computes
    (FREETOKEN_HYBRID_PREFETCH=0.75; ``+prefetch0``: the split's share; else the engine's
    default), ``+chunk`` dequantises a prompt's streamed experts a staging chunk at a time
    (FREETOKEN_PREFILL_DEQUANT=chunk; else one by one)."""
    base, *options = name.split("+")
    shares = [o for o in options if o.startswith("prefetch") and o[8:].isdigit()]
    os.environ["FREETOKEN_HYBRID_PREFETCH"] = f"{int(shares[-1][8:]) / 100}" if shares else ""
    unknown = set(options) - set(shares) - {
        "dequant", "lookahead", "nolookahead", "torchcopy", "pyslots", "pycall", "nojoin",
        "hostnode", "flags", "pieces", "early", "greedy", "nocheck", "timing", "regrouped",
        "denseblocks", "greedysplit", "lateflags", "pdl", "nopdl",
        "fusedrouter", "matmulrouter", "chunk", "fileblocks", "densedequant"}
    if unknown:
        raise SystemExit(f"unknown strategy option(s) {', '.join(sorted(unknown))} in {name!r}")
    os.environ["FREETOKEN_GPU_EXPERT_KERNEL"] = "dequant" if "dequant" in options else "auto"
    os.environ["FREETOKEN_ROW_COPY"] = "torch" if "torchcopy" in options else "native"
    os.environ["FREETOKEN_EXPERT_SLOTS"] = "python" if "pyslots" in options else "native"
    os.environ["FREETOKEN_LAYER_CALL"] = "python" if "pycall" in options else "native"
    # else the engine's defaults
    set_env("FREETOKEN_CPU_HOST_NODE", {"hostnode": "on", "flags": "flag", "pieces": "off"},
            options)
    set_env("FREETOKEN_HOST_STEPS", {"flags": "flags", "pieces": "pieces", "early": "early"},
            options)
    os.environ["FREETOKEN_WALL_CHECK"] = "off" if "nocheck" in options else "on"
    set_env("FREETOKEN_RESIDENT_BLOCKS", {"regrouped": "regrouped", "fileblocks": "file"},
            options)
    set_env("FREETOKEN_GPU_DENSE", {"denseblocks": "blocks", "densedequant": "dequant"}, options)
    os.environ["FREETOKEN_LATE_STEPS"] = "flags" if "lateflags" in options else "breaks"
    os.environ["FREETOKEN_PREFILL_DEQUANT"] = "chunk" if "chunk" in options else "expert"
    set_env("FREETOKEN_GPU_PDL", {"pdl": "on", "nopdl": "off"}, options)
    set_env("FREETOKEN_GPU_ROUTER", {"fusedrouter": "fused", "matmulrouter": "matmul"}, options)
    strategy, max_fetch, online, capture = VARIANTS.get(base, (base, "auto", True, True))
    timed = args.prefill_strategies is None or name in args.prefill_strategies.split(",")
    prefill = [int(n) for n in args.prefill_tokens.split(",") if n and timed]
    capture = capture and args.device == "cuda"
    graphs = args.cuda_graph_max_bs if capture else 0
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                       moe_strategy=strategy,
                       max_seq_len=max([args.tokens + 256] + [n + 16 for n in prefill]),
                       cuda_graph_max_bs=graphs, moe_cpu_threads=args.moe_cpu_threads,
                       moe_cpu_spin_us=args.moe_cpu_spin_us,
                       moe_cache=CacheSizing("mem", parse_bytes(args.moe_cache_mem)),
                       moe_hybrid_max_fetch=max_fetch, moe_hybrid_online=online,
                       moe_hybrid_greedy="split" if "greedysplit" in options else "fetch",
                       moe_lookahead="off" if "nolookahead" in options
                       else "on" if "lookahead" in options else "auto")
    t0 = time.perf_counter()
    engine = Engine(cfg)
    load_s = time.perf_counter() - t0
    if "nojoin" in options and engine.runner.pool is not None:
        engine.runner.pool.set_join(False)
    ids = engine.encode(args.prompt)
    temperature = 0.0 if "greedy" in options else args.temperature
    sampling = dict(temperature=temperature, seed=args.seed, ignore_eos=True)
    engine.generate(ids, SamplingParams(max_tokens=args.warmup_tokens, **sampling))  # warm-up
    rt = engine.runner.offload
    cpu_layers = [m for m in engine.model.modules() if isinstance(m, CpuExperts)]
    if "timing" in options and engine.runner.pool is not None:  # after the warm-up
        engine.runner.pool.set_timing(True)
    runs = []
    for _ in range(args.repeats):
        before = rt.stats.snapshot() if rt else None
        steps_before = host_step_totals(cpu_layers)
        search_before, fetching_before = search_tokens(engine), fetching_steps(engine)
        stats = GenerationStats()
        t = time.perf_counter()
        engine.generate(ids, SamplingParams(max_tokens=args.tokens, **sampling), stats=stats)
        wall = time.perf_counter() - t
        after = rt.stats.snapshot() if rt else None
        steps = {k: v - steps_before[k] for k, v in host_step_totals(cpu_layers).items()}
        moe = moe_delta(before, after)
        # the engine log line's breakdown for this run, per generated token (prefill in it)
        made = max(1, stats.output_tokens)
        breakdown = (f"per token {1e3 * wall / made:.1f} ms"
                     + (experts_part(moe, None, made) if moe else "")
                     + cpu_pool_part(steps, None, made))
        runs.append({"decode_tokens_per_s": stats.decode_tokens_per_s,
                     "prefill_s": stats.prefill_s, "wall_s": wall,
                     "moe": moe, "cpu_host_steps": steps, "breakdown": breakdown,
                     # hybrid: tokens in the wall check's arms, steps in all-fetch graphs
                     "search_tokens": search_tokens(engine) - search_before,
                     "fetching_steps": fetching_steps(engine) - fetching_before})
    best = max(runs, key=lambda r: r["decode_tokens_per_s"])
    prefill_tps = {str(n): prefill_tokens_per_s(engine, n, args.repeats) for n in prefill}
    if best["cpu_host_steps"]["calls"]:  # cpu between graph pieces: where its wall went
        steps = best["cpu_host_steps"]
        out_steps = {"share_cpu_host_step": steps["step_s"] / best["wall_s"],
                     "share_cpu_job": steps["job_s"] / best["wall_s"],
                     "us_per_host_step": 1e6 * steps["step_s"] / steps["calls"],
                     "us_per_cpu_job": 1e6 * steps["job_s"] / steps["calls"]}
    else:
        out_steps = {}
    if "timing" in options:
        out_steps["pool_jobs"] = pool_jobs(engine, engine.runner.pool.threads + 1
                                           if engine.runner.pool is not None else 1)
    # per layer: the cached layers' kernel, and resident's where it keeps the file's blocks
    # ("parameters": dequantised at load, the torch paths)
    kernels = [m.gpu_kernel if isinstance(m, OffloadExperts) or m.in_blocks is not None
               else "parameters" for m in engine.model.modules()
               if isinstance(m, OffloadExperts | ResidentExperts)]
    out: dict[str, Any] = {"strategy": name, "load_s": load_s, "cuda_graph_max_bs": graphs,
                           "runs": runs, "decode_tokens_per_s": best["decode_tokens_per_s"],
                           "breakdown": best["breakdown"],
                           "prefill_tokens_per_s": prefill_tps, **out_steps,
                           "gpu_expert_kernels": {k: kernels.count(k) for k in set(kernels)}}
    if rt is not None:
        moe = best["moe"]
        seconds = best["wall_s"]
        gather = gather_bytes_per_s(engine, args.gather_experts)
        roofline = gather / moe["bytes_per_token"] if moe["bytes_per_token"] else float("inf")
        expert = next(m.bank.expert_bytes for m in engine.model.modules()
                      if isinstance(m, OffloadExperts) and m.bank is not None)
        miss_bytes = moe["bytes_per_token"] + expert * moe["cpu_experts"] / moe["tokens"]
        hybrid_gbps = hybrid_roofline_gbps(engine)
        if hybrid_gbps:
            out |= {"hybrid_overlapped_gbps": hybrid_gbps, "all_miss_bytes_per_token": miss_bytes,
                    "hybrid_roofline_tokens_per_s": hybrid_gbps * 1e9 / miss_bytes,
                    "fraction_of_hybrid_roofline":
                        best["decode_tokens_per_s"] * miss_bytes / (hybrid_gbps * 1e9),
                    "share_cpu_wait": moe["cpu_s"] / seconds,
                    "fetch_fractions": {k: v.get("fetch_fraction") for k, v in
                                        rt.stats.snapshot()["layers"].items()},
                    "split_costs_us": split_costs(engine)}
        out |= {
            "cache_slots": rt.cache.num_slots, "cache_bytes": rt.cache.nbytes,
            "hit_rate": moe["hit_rate"], "miss_bytes_per_token": moe["bytes_per_token"],
            "lookahead_hit_rate": moe["lookahead_hit_rate"], "prefetched_per_token":
                moe["prefetched"] / moe["tokens"] if moe["tokens"] else 0.0,
            "gather_bytes_per_s": gather, "pcie_roofline_tokens_per_s": roofline,
            "fraction_of_roofline": best["decode_tokens_per_s"] / roofline,
            "share_fetch": moe["fetch_s"] / seconds, "share_expert_compute":
                moe["compute_s"] / seconds, "share_plan": moe["plan_s"] / seconds,
        }
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1), flush=True)
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def add_serial_ceilings(results: list[dict[str, Any]]) -> None:
    """Each cached strategy's serial ceiling (module doc), from resident's speed in this run."""
    resident = next((r["decode_tokens_per_s"] for r in results
                     if r.get("strategy") == "resident" and "decode_tokens_per_s" in r), None)
    if not resident:
        return
    for r in results:
        hybrid = "hybrid_overlapped_gbps" in r  # its fetched bytes alone are not its link time
        links = [("hybrid", r.get("all_miss_bytes_per_token"),
                  (r.get("hybrid_overlapped_gbps") or 0) * 1e9) if hybrid else
                 ("pcie", r.get("miss_bytes_per_token"), r.get("gather_bytes_per_s"))]
        for name, nbytes, rate in links:
            if nbytes is None or not rate:
                continue
            ceiling = 1 / (1 / resident + nbytes / rate)
            r[f"{name}_serial_ceiling_tokens_per_s"] = ceiling
            r[f"fraction_of_{name}_serial_ceiling"] = r["decode_tokens_per_s"] / ceiling
            print(f"{r['strategy']}: {name} serial ceiling {ceiling:.1f} tok/s, reached "
                  f"{100 * r['decode_tokens_per_s'] / ceiling:.0f} %", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--strategies", default="resident,offload")
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--moe-cpu-threads", type=int, default=0)
    p.add_argument("--moe-cpu-spin-us", type=int, default=1000)
    p.add_argument("--prompt", default="The history of computing")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 decodes greedily; chat clients send 1 (each run seeded by --seed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-tokens", default="",
                   help="comma-separated prompt lengths to time prefill at (e.g. 512,4096)")
    p.add_argument("--prefill-strategies",
                   help="the strategies whose prefill is timed (default: all of --strategies)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="tokens decoded before the timed runs; hybrid's wall check times its "
                        "arms on the first calls (16 + 4 x 10 a layer kind, then again after "
                        "32, 64, ... calls), so a longer warm-up times the split it settles on")
    p.add_argument("--gather-experts", type=int, default=8, help="experts per copy batch")
    p.add_argument("--cuda-graph-max-bs", type=int, default=16)
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    # the MoE plan's lines (auto's choice, the core plan) on stderr, where small_box.py reads them
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("freetoken.moe.plan").setLevel(logging.INFO)
    results = []
    for name in args.strategies.split(","):
        try:
            results.append(run_strategy(args, name))
        except Exception as e:  # record it and go on: one broken strategy must not lose the rest
            print(f"error: {name}: {type(e).__name__}: {e}", flush=True)
            results.append({"strategy": name, "error": f"{type(e).__name__}: {e}"})
            gc.collect()
    add_serial_ceilings(results)
    result = {
        "bench": "decode_moe", "label": args.label, **git_state(args.git_sha), **host(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "params": vars(args) | {"out": str(args.out)}, "strategies": results,
    }
    save_result(args.out, f"decode_moe-{args.label or Path(args.model).stem}-{args.device}", result)


if __name__ == "__main__":
    main()
