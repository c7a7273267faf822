"""Plots of hybrid against offload for docs/benchmarks.md: the split's runs, the fp4 files, the
small box, the decode check and look-ahead's prefetch share (``benchmarks/plot.py`` draws them
with the rest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def split_runs_plot() -> None:
    """Every 12-layer run of offload, hybrid (online) and auto on 16 cores of the H200 machine
    at temperature 1, by commit (docs/benchmarks.md, "A split that settles")."""
    res = ROOT / "benchmarks/results"
    files = sorted(res.glob("decode_moe-qwen3-30b-a3b-12l-ab-*-h200-cuda-179622*.json")) + \
        sorted(res.glob("decode_moe-qwen3-30b-a3b-12l-h200-16cores-native-t15-*-cuda-*.json"))
    runs: dict[str, dict[str, list[float]]] = {}
    for f in files:
        d = json.loads(f.read_text())
        for s in d["strategies"]:
            runs.setdefault(d["sha"], {}).setdefault(s["strategy"], []).append(
                s["decode_tokens_per_s"])
    if not runs:
        return
    colors = {"offload": "#888888", "hybrid-online": "#3a6ea5", "auto": "#d08770"}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, by in enumerate(runs.values()):
        for j, (name, color) in enumerate(colors.items()):
            ys = by.get(name, [])
            ax.scatter([i + 0.15 * (j - 1)] * len(ys), ys, color=color,
                       label=name if i == 0 or name not in runs[next(iter(runs))] else None)
    ax.axhline(118.2, color="#aa3333", ls="--", label="llama.cpp -ncmoe 10 (99c6510 run)")
    ax.set_xticks(range(len(runs)), list(runs), fontsize=8)
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title("12-layer qwen3-30b-a3b q8_0, 4 GB cache, 15 threads, H200: each run",
                 fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    ax.legend(seen.values(), seen.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/split_runs.png", dpi=120)
    plt.close(fig)


def hybrid_vs_offload_plot() -> None:
    """Hybrid (and auto) against offload on the 12-layer Gemma-4 fp4 files, run by run (the
    wall check's arms fall in some runs): look-ahead under the split (e66b140) and decode
    graphs for steps that fetch every miss (2f8d14c)."""
    bars: list[tuple[str, list[float]]] = []
    for f in sorted((ROOT / "benchmarks/results").glob("decode_moe-g4-*-12l-h100-cuda-*.json")):
        d = json.loads(f.read_text())
        fmt = d["label"].split("-")[1]
        for r in d["strategies"]:
            runs = [x["decode_tokens_per_s"] for x in r["runs"]]
            bars.append((f"{fmt} {r['strategy']} ({d['sha']})", runs))
    if not bars:
        return
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, (_, runs) in enumerate(bars):
        for k, t in enumerate(runs):
            ax.bar(i + (k - 0.5) * 0.38, t, width=0.36,
                   color="#888888" if "offload" in bars[i][0] else "#3a6ea5",
                   alpha=1.0 if k else 0.55)
    ax.set_xticks(range(len(bars)), [name for name, _ in bars], rotation=35, fontsize=6,
                  ha="right")
    ax.set_ylim(100, None)
    ax.set_ylabel("decode tok/s, runs 1 and 2")
    ax.set_title("12-layer gemma4-26b-a4b fp4 files, 1.6 GB cache, temperature 1, H100",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/hybrid_vs_offload_12l.png", dpi=120)
    plt.close(fig)


def small_box_plot(sha: str = "31231cc", layers: int = 48) -> None:
    """The second seed's box emulated: offload, hybrid and auto per row (cores, ISA, pool
    threads), each row with its own ``ft bench bw`` profile, from one sitting's JSON files."""
    rows = []
    for f in sorted((ROOT / "benchmarks/results").glob(
            f"small_box-qwen3-30b-a3b-{layers}l-*.json")):
        d = json.loads(f.read_text())
        if str(d.get("sha", "")).startswith(sha):
            rows += d["rows"]
    if not rows:
        return
    names = ("offload", "hybrid-online", "auto")
    colors = ("#888888", "#3a6ea5", "#6a9955")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, row in enumerate(rows):
        for k, (name, color) in enumerate(zip(names, colors, strict=True)):
            ax.bar(i + (k - 1) * 0.27, row["medians"][name], width=0.25, color=color,
                   label=name if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"{r['cores']} cores, {r['isa']}, {r['threads']} threads"
                                     for r in rows], fontsize=7)
    _decode_bars_done(fig, ax, f"{layers}-layer qwen3-30b-a3b q8_0 under taskset, 4 GB "
                      f"cache, H100 ({sha})", f"small_box_{layers}l_{sha}.png")


def _decode_bars_done(fig: Any, ax: Any, title: str, name: str) -> None:
    """A decode tok/s bar plot's labels, legend and file (docs/img/``name``)."""
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img" / name, dpi=120)
    plt.close(fig)


def decode_check_plot(sha: str = "c266304") -> None:
    """``ft bench bw --decode-check`` per file: offload and hybrid as the check measured them,
    then offload and auto in their own processes (medians), from one sitting's small_box
    files and the profiles they read."""
    files = {"gemma4-26b-a4b-nvfp4-30l": "gemma4-nvfp4-30l-h100", "qwen3-30b-a3b-48l":
             "qwen3-48l-h100"}
    bars = []
    for label, profile in files.items():
        runs = [json.loads(f.read_text()) for f in sorted(
            (ROOT / "benchmarks/results").glob(f"small_box-{label}-*.json"))]
        runs = [d for d in runs if str(d.get("sha", "")).startswith(sha)]
        prof = ROOT / f"benchmarks/results/benchbw-{sha}/{profile}.json"
        if not runs or not prof.exists():
            return
        (row,) = json.loads(prof.read_text())["layer_kinds"].values()
        check = row["decode"]["tokens_per_s"]
        medians = runs[-1]["rows"][0]["medians"]
        bars.append((label, check["offload"], check["hybrid"], medians["offload"],
                     medians["auto"]))
    names = ("check: offload", "check: hybrid", "offload", "auto")
    colors = ("#bbbbbb", "#9fb8d8", "#888888", "#6a9955")
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (_, *values) in enumerate(bars):
        for k, (v, name, color) in enumerate(zip(values, names, colors, strict=True)):
            ax.bar(i + (k - 1.5) * 0.2, v, width=0.18, color=color,
                   label=name if i == 0 else None)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    _decode_bars_done(fig, ax, f"ft bench bw --decode-check, then auto; 4 GB cache, 15 threads, "
                      f"H100 ({sha})", f"decode_check_{sha}.png")


def prefetch_share_plot(sha: str = "945b265") -> None:
    """Hybrid with look-ahead fetching a share of the next layer's predicted misses
    (``+prefetchNN``), each variant's runs of one sitting's decode_moe files, against the
    same machine's best llama.cpp placement."""
    files = sorted((ROOT / "benchmarks/results").glob("decode_moe-qwen3-30b-a3b-48l-pf*.json"))
    runs: dict[str, list[float]] = {}
    for f in files:
        d = json.loads(f.read_text())
        if not str(d.get("sha", "")).startswith(sha):
            continue
        for r in d["strategies"]:
            runs.setdefault(r["strategy"], []).append(r["decode_tokens_per_s"])
    llama = ROOT / f"benchmarks/results/llama-{sha}/ncmoe.json"
    if not runs or not llama.exists():
        return
    best = json.loads(llama.read_text())[0]["avg_ts"]
    names = {"hybrid-online": "look-ahead\nwhile all-fetch", "hybrid-online+lookahead":
             "split's share", **{f"hybrid-online+lookahead+prefetch{n}": f"{n} %"
                                 for n in (30, 40, 55, 70)}}
    order = [k for k in names if k in runs]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, k in enumerate(order):
        for j, v in enumerate(runs[k]):
            ax.bar(i + (j - 0.5) * 0.35, v, width=0.33, color="#6a9955" if "40" in k
                   else "#9fb8d8", label=None)
    ax.axhline(best, color="#aa4444", linestyle="--", label=f"llama.cpp -ncmoe 42 ({best:.1f})")
    ax.set_xticks(range(len(order)), [names[k] for k in order], fontsize=8)
    _decode_bars_done(fig, ax, "hybrid: share of predicted misses fetched early; qwen3 48l "
                      f"q8_0, 4 GB, H100 ({sha})",
                      f"prefetch_share_{sha}.png")


# one hybrid layer's critical path, in the order the step runs it (step_timeline.py)
CHAIN = (("before_plan", "sync -> plan"), ("cpu_job", "CPU job"),
         ("job_to_host", "job -> host"), ("wait_to_launch", "host -> launch"),
         ("launch", "launch"), ("gpu_attention", "GPU attention"),
         ("ids_to_host", "ids -> host"))


def timeline_plot(sha: str) -> None:
    """A layer's period split along its critical path (medians over the layers of a decode
    run's steps), from ``step_timeline-*`` results at ``sha``."""
    res = ROOT / "benchmarks/results"
    runs = [d for f in sorted(res.glob("step_timeline-*.json"))
            if (d := json.loads(f.read_text()))["sha"] == sha
            and d["segments_us"].get("layer_rows")]
    if not runs:
        return
    d = runs[0]
    seg = d["segments_us"]
    fig, ax = plt.subplots(figsize=(7, 2.3))
    left = 0.0
    colours = ("#999999", "#d08c2c", "#999999", "#aa3333", "#aa3333", "#3a6ea5", "#aa3333")
    for (key, name), colour in zip(CHAIN, colours, strict=True):
        width = seg[key]["median"]
        ax.barh(0, width, left=left, color=colour, edgecolor="white")
        if width > 25:
            ax.text(left + width / 2, 0, f"{name}\n{width:.0f}", ha="center", va="center",
                    fontsize=6, color="white")
        left += width
    ax.set_yticks([])
    ax.set_xlabel(f"us of one layer's period (median {seg['period']['median']:.0f}); "
                  "red: the engine thread, blue: the GPU, orange: the CPU pool", fontsize=7)
    card = "H100" if "h100" in d["params"]["label"] else "GPU"
    ax.set_title(f"hybrid on the 48-layer qwen3-30b-a3b q8_0, {card} ({sha}): "
                 f"{d['tokens_per_s']:.1f} tok/s", fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / f"docs/img/timeline_{sha}.png", dpi=120)
    plt.close(fig)
