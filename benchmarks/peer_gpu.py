"""Ours against llama.cpp on the GPU machine, same file, one run: merges ``llama-bench -o json``
outputs (one per placement) with a ``decode_moe.py`` result into ``peer_gpu-*.json``, where each
of our strategies carries ``tokens_per_s`` and ``ratio_to_llamacpp`` (over the best llama.cpp
placement of the run that keeps at most ``--expert-vram`` of experts on the GPU; resident is
compared with llama.cpp all on the GPU, cpu with every expert on the CPU, ``ot_cpu``).

    python benchmarks/peer_gpu.py --llama ncmoe10=a.json ot_cpu=b.json gpu=c.json \\
        --ours decode_moe-....json --expert-vram-gb 5 --label ... --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import git_state, host, save_result  # noqa: E402


def llama_rows(specs: list[str]) -> dict[str, dict[str, object]]:
    """``name=path`` of llama-bench JSON -> the decode row (n_gen > 0) of each placement."""
    out: dict[str, dict[str, object]] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        try:
            tests = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            out[name] = {"error": f"{path}: {e}"}
            continue
        gen = [t for t in tests if t.get("n_gen", 0) > 0]
        if gen:
            t = gen[0]
            out[name] = {"tokens_per_s": t["avg_ts"], "stddev": t.get("stddev_ts"),
                         "n_cpu_moe": t.get("n_cpu_moe"), "n_threads": t.get("n_threads"),
                         "n_gen": t["n_gen"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llama", nargs="+", required=True, metavar="NAME=JSON",
                   help="llama-bench -o json per placement; 'gpu' names the all-on-GPU one")
    p.add_argument("--offloaded", nargs="+", default=None, metavar="NAME",
                   help="the placements that keep at most the compared expert VRAM on the GPU "
                   "(default: every one but 'gpu')")
    p.add_argument("--ours", type=Path, required=True, help="a decode_moe.py result")
    p.add_argument("--llama-machine", default="",
                   help="an id of the machine llama-bench ran on (its GPU's UUID, say), compared "
                   "with --machine: ratios across two machines are not one run's")
    p.add_argument("--machine", default="", help="the same id of the machine ours ran on")
    p.add_argument("--model", default="")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    peers = llama_rows(args.llama)
    offloaded = args.offloaded or [n for n in peers if n != "gpu"]
    speeds = {n: r["tokens_per_s"] for n, r in peers.items() if "tokens_per_s" in r}
    best = max((n for n in offloaded if n in speeds), key=speeds.get, default=None)
    ours = json.loads(args.ours.read_text())
    rows = []
    for s in ours["strategies"]:
        row = {"strategy": s["strategy"], "tokens_per_s": s.get("decode_tokens_per_s"),
               "hit_rate": s.get("hit_rate"), "error": s.get("error")}
        # resident against all on the GPU, cpu against every expert on the CPU (-ot exps=CPU)
        ref = {"resident": "gpu", "cpu": "ot_cpu"}.get(s["strategy"].split("+")[0], best)
        ref = ref if ref in speeds else best
        if ref in speeds and row["tokens_per_s"]:
            row |= {"compared_with": ref, "ratio_to_llamacpp": row["tokens_per_s"] / speeds[ref]}
        for k in ("share_fetch", "share_plan", "share_cpu_wait", "share_expert_compute",
                  "share_cpu_host_step", "share_cpu_job", "prefill_tokens_per_s"):
            if k in s:
                row[k] = s[k]
        rows.append(row)
        print(row, flush=True)
    # the host is the one both engines ran on, recorded in our result (merging may happen elsewhere)
    ran_on = {k: ours[k] for k in ("host", "platform", "cpu", "cores", "torch", "gpu") if k in ours}
    result = {"bench": "peer_gpu", "label": args.label, **git_state(args.git_sha),
              **(ran_on or host()),
              "params": vars(args) | {"out": str(args.out), "ours": str(args.ours)},
              "ours_params": ours.get("params"), "llamacpp": peers,
              "same_machine": (args.llama_machine == args.machine
                               if args.llama_machine and args.machine else None),
              "best_offloaded_llamacpp": best, "strategies": rows}
    if result["same_machine"] is False:
        print(f"llama.cpp ran on machine {args.llama_machine}, ours on {args.machine}: the "
              "ratios compare two machines", flush=True)
    save_result(args.out, f"peer_gpu-{args.label or 'h200'}", result)


if __name__ == "__main__":
    main()
