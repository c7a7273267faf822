"""A small-core box emulated on a big one: decode speed of each MoE strategy with the process
held to a few cores, compared with offload's in interleaved rounds.

Per row ``CORES:ISA[:THREADS]`` (``--rows``): the process limited to CORES cores (taskset), the
CPU kernels capped at ISA (``FREETOKEN_CPU_ISA``; ``native``: no cap), THREADS pool workers
(default CORES - 1). Each of ``--rounds`` rounds runs every strategy once, in turn, each in its
own process (an engine built after another in one process inherits its threads' placement), so
a slow spell of the machine falls on every strategy alike. Run-to-run spread on the GPU machine
is about 15 %: the row's figure is each strategy's median over the rounds, and its ratio to
offload's median. One JSON in ``--out`` holds every run (tok/s, hit rate, the step's shares:
plan, fetch, CPU wait; the split's fractions and costs) and the medians.

With ``--bench-bw`` each row first runs ``ft bench bw --model`` under its own limits into a
profile of its own, which that row's runs read: ``auto`` then decides from a row measured on
the box it runs on (without it, a profile measured elsewhere makes auto offload).

    python benchmarks/small_box.py --model M.gguf --rows 4:avx2,8:avx2,16:native --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host  # noqa: E402

KEEP = ("decode_tokens_per_s", "breakdown", "hit_rate", "lookahead_hit_rate", "share_plan",
        "share_fetch", "share_cpu_wait", "fetch_fractions", "split_costs_us", "error")
# the engine's log lines kept with a run (moe/plan.py): auto's choice, the core plan, a shrink
SAID = ("--moe-strategy auto:", "MoE plan:", "core plan:", "no core of its own",
        "one usable core")


def parse_row(text: str) -> tuple[int, str, int]:
    """``CORES:ISA[:THREADS]`` -> (cores, isa, pool threads)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        raise SystemExit(f"--rows: {text!r} is not CORES:ISA[:THREADS] (e.g. 4:avx2)")
    cores = int(parts[0])
    threads = int(parts[2]) if len(parts) == 3 else max(1, cores - 1)
    return cores, parts[1], threads


def row_env(cores: int, isa: str, profile: Path | None) -> dict[str, str]:
    """The environment of a row's processes: the ISA cap, the row's own profile if any."""
    env = dict(os.environ)
    if isa != "native":
        env["FREETOKEN_CPU_ISA"] = isa
    if profile is not None:
        env["FREETOKEN_BENCHBW_PATH"] = str(profile)
    return env


def bench_row(args: argparse.Namespace, cores: int, isa: str, threads: int,
              profile: Path) -> dict[str, Any]:
    """``ft bench bw --model`` under the row's limits into ``profile``: its rows, or the
    error."""
    cmd = ["taskset", "-c", f"0-{cores - 1}", sys.executable, "-m", "freetoken.cli", "bench",
           "bw", "--model", args.model, "--device", args.device, "--threads", str(threads),
           "--out", str(profile)]
    if args.decode_check:
        cmd += ["--decode-check", args.moe_cache_mem]
    done = subprocess.run(cmd, env=row_env(cores, isa, None), capture_output=True, text=True)
    if done.returncode != 0 or not profile.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}
    kinds = json.loads(profile.read_text()).get("layer_kinds", {})
    return {k: {m: round(v, 1) for m, v in row.items() if isinstance(v, float)}
            | ({"decode": row["decode"]} if "decode" in row else {}) for k, row in kinds.items()}


def one_run(args: argparse.Namespace, cores: int, isa: str, threads: int,
            strategy: str, profile: Path | None = None) -> dict[str, Any]:
    """One strategy in its own process under the row's limits: what decode_moe.py saved."""
    env = row_env(cores, isa, profile)
    with tempfile.TemporaryDirectory() as scratch:
        cmd = ["taskset", "-c", f"0-{cores - 1}", sys.executable,
               str(Path(__file__).parent / "decode_moe.py"), "--model", args.model,
               "--device", args.device, "--temperature", str(args.temperature),
               "--strategies", strategy, "--moe-cache-mem", args.moe_cache_mem,
               "--moe-cpu-threads", str(threads), "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), "--out", scratch]
        if args.git_sha:
            cmd += ["--git-sha", args.git_sha]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        saved = sorted(Path(scratch).glob("*.json"))
        if not saved:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return {"strategy": strategy, "error": f"exit {done.returncode}: {' | '.join(tail)}"}
        run = json.loads(saved[-1].read_text())["strategies"][0]
    # what auto chose, the core plan and a pool shrunk to the cores it may use, as the engine
    # logged them
    said = [line.strip() for line in (done.stdout + done.stderr).splitlines()
            if any(k in line for k in SAID)]
    kept = {k: run[k] for k in KEEP if k in run}
    return {"strategy": strategy, **kept, **({"log": said[-6:]} if said else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", default="4:avx2", help="CORES:ISA[:THREADS], comma separated")
    p.add_argument("--strategies", default="offload,hybrid-online,auto")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--moe-cache-mem", default="4GB")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="decode_moe.py's, best kept")
    p.add_argument("--bench-bw", action="store_true",
                   help="per row, ft bench bw --model under its limits first (auto's profile)")
    p.add_argument("--decode-check", action="store_true",
                   help="with --bench-bw: ft bench bw --decode-check at --moe-cache-mem "
                   "(offload and the recommended strategy decode the model; auto offloads where "
                   "offload was faster)")
    p.add_argument("--profile", type=Path,
                   help="the profile of every row: --bench-bw writes it here (else to a "
                   "scratch file), without --bench-bw it is read as it is")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    strategies = args.strategies.split(",")
    rows: list[dict[str, Any]] = []
    path = args.out / f"small_box-{args.label or Path(args.model).stem}-{int(time.time())}.json"

    def save() -> None:  # after every run: a call cut by its time limit keeps what it measured
        result = {"bench": "small_box", **git_state(args.git_sha), **host(),
                  "params": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()}, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")

    for text in args.rows.split(","):
        cores, isa, threads = parse_row(text)
        if cores > len(os.sched_getaffinity(0)):
            print(f"== {text}: skipped, this process may use {len(os.sched_getaffinity(0))} "
                  "cores", flush=True)
            continue
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
        row: dict[str, Any] = {"cores": cores, "isa": isa, "threads": threads, "runs": runs}
        rows.append(row)
        profile = args.profile
        if args.bench_bw:
            profile = profile or Path(tempfile.mkdtemp()) / "benchbw.json"
            row["bench_bw"] = bench_row(args, cores, isa, threads, profile)
            save()
            print(f"== {cores} cores, {isa}, {threads} threads: ft bench bw {row['bench_bw']}",
                  flush=True)
        for r in range(args.rounds):
            for s in strategies:
                run = one_run(args, cores, isa, threads, s, profile)
                runs[s].append(run)
                save()
                print(f"== {cores} cores, {isa}, {threads} threads, round {r + 1}: {s} "
                      f"{run.get('decode_tokens_per_s', run.get('error'))}; "
                      f"{run.get('breakdown', '')}", flush=True)
        medians = {s: statistics.median(v) for s, rs in runs.items()
                   if (v := [x["decode_tokens_per_s"] for x in rs
                             if "decode_tokens_per_s" in x])}
        base = medians.get("offload")
        ratios = {s: m / base for s, m in medians.items()} if base else {}
        print(f"== {cores} cores, {isa}: medians " + ", ".join(
            f"{s} {m:.1f}" + (f" ({ratios[s]:.2f}x offload)" if s in ratios else "")
            for s, m in medians.items()), flush=True)
        row |= {"medians": medians, "ratio_to_offload": ratios}
        save()
    save()
    print(f"saved {path}", flush=True)


if __name__ == "__main__":
    main()
