"""Plots for docs/benchmarks.md from the JSON in benchmarks/results/.

    python benchmarks/plot.py      (needs matplotlib)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plot_hybrid import (  # noqa: E402
    decode_check_plot,
    hybrid_vs_offload_plot,
    prefetch_share_plot,
    small_box_plot,
    split_runs_plot,
    timeline_plot,
)


def resident_gpu_plot() -> None:
    """Resident decode on the 12-layer qwen3 q8_0 file per commit, beside llama.cpp all on the
    GPU (docs/benchmarks.md, "Resident from the file's blocks")."""
    runs = []
    for p in sorted((ROOT / "benchmarks/results").glob("decode_moe-qwen3-30b-a3b-12l-*.json")):
        r = json.loads(p.read_text())
        rows = {s["strategy"]: s for s in r.get("strategies", [])}
        if "resident" in rows and r.get("params", {}).get("temperature") == 1.0:
            runs.append((r["timestamp"] if "timestamp" in r else p.stem.split("-")[-1],
                         r["sha"], rows["resident"]["decode_tokens_per_s"]))
    peers = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks/results").glob(
        "peer_gpu-qwen3-30b-a3b-12l-*.json"))]
    if not runs:
        return
    runs.sort()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(range(len(runs)), [t for _, _, t in runs], color="#3a6ea5", label="ours, resident")
    for peer in peers[-1:]:
        ax.axhline(peer["llamacpp"]["gpu"]["tokens_per_s"], color="#aa3333", ls="--",
                   label="llama.cpp, all on the GPU")
    ax.set_xticks(range(len(runs)), [sha for _, sha, _ in runs], rotation=30, fontsize=8)
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title("12-layer qwen3-30b-a3b q8_0, H200", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/resident_gpu.png", dpi=120)
    plt.close(fig)


def lookahead_plot() -> None:
    """Offload and hybrid decode with look-ahead on and off, per run on the 12-layer qwen3
    q8_0 file (docs/benchmarks.md, "Look-ahead")."""
    names = ("offload", "offload+nolookahead", "hybrid-online", "hybrid-online+nolookahead")
    runs = []
    for p in sorted((ROOT / "benchmarks/results").glob("decode_moe-qwen3-30b-a3b-12l-*.json")):
        r = json.loads(p.read_text())
        rows = {s["strategy"]: s["decode_tokens_per_s"] for s in r.get("strategies", [])
                if "decode_tokens_per_s" in s}
        if any(n.endswith("+nolookahead") and n in rows for n in names):
            runs.append((p.stem.split("-")[-1], r["sha"], rows))
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(7, 3.2))
    width = 0.8 / len(names)
    colors = ("#3a6ea5", "#9bb8d8", "#c46f2a", "#e8b98f")
    # in these runs hybrid-online had look-ahead on (the default until 965c7bf)
    labels = ("offload, look-ahead", "offload, none", "hybrid (online), look-ahead",
              "hybrid (online), none")
    for i, (name, color, label) in enumerate(zip(names, colors, labels, strict=True)):
        xs = [k + i * width for k in range(len(runs)) if name in runs[k][2]]
        ax.bar(xs, [r[name] for _, _, r in runs if name in r], width, color=color,
               label=label)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(runs))],
                  [f"{sha} run {k + 1}" for k, (_, sha, _) in enumerate(runs)], fontsize=8)
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title("12-layer qwen3-30b-a3b q8_0, 4 GB expert cache, H200", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/lookahead.png", dpi=120)
    plt.close(fig)


def peer_48l_plot() -> None:
    """Hybrid and offload decode on the 48-layer qwen3 q8_0 file, each run in order, beside
    llama.cpp's placements (docs/benchmarks.md, "The link's copies in one library call")."""
    found = sorted((ROOT / "benchmarks/results").glob(
        "peer_gpu-qwen3-30b-a3b-48l-h200-two-calls-*.json"))
    if not found:
        return
    peer = json.loads(found[-1].read_text())
    runs = peer["ours"]["runs_in_order"]
    llama = peer["llamacpp"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(range(len(runs)), [t for _, t in runs], color="#3a6ea5", label="ours")
    for key, label, color in (("ncmoe_42", "llama.cpp -ncmoe 42", "#aa3333"),
                              ("ot_exps_cpu", "llama.cpp -ot exps=CPU", "#d08770")):
        ax.axhline(llama[key], color=color, ls="--", label=label)
    ax.set_xticks(range(len(runs)), [name for name, _ in runs], rotation=15, fontsize=8)
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title(f"48-layer qwen3-30b-a3b q8_0, 4 GB expert cache, H200 ({peer['sha']})",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/peer_48l.png", dpi=120)
    plt.close(fig)


def resident_sitting_plot(sha: str, file: str = "qwen3-30b-a3b-48l",
                          names: dict[str, str] | None = None) -> None:
    """One sitting's resident runs (every variant, named by ``names`` where given) beside
    llama.cpp all on the GPU."""
    runs, gpu_line, card = [], 0.0, "H200"
    for f in sorted((ROOT / "benchmarks/results").glob(f"peer_gpu-{file}-*.json")):
        peer = json.loads(f.read_text())
        if not str(peer.get("sha", "")).startswith(sha):
            continue
        gpu_line = peer["llamacpp"]["gpu"]["tokens_per_s"]
        card = "H100" if "H100" in str(peer.get("gpu")) else card
        runs += [((names or {}).get(r["strategy"], r["strategy"]), r["tokens_per_s"])
                 for r in peer["strategies"]
                 if r["strategy"].startswith("resident") and r["tokens_per_s"]]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(range(len(runs)), [t for _, t in runs], color="#3a6ea5")
    ax.axhline(gpu_line, color="#aa3333", ls="--",
               label=f"llama.cpp all on the GPU ({gpu_line:.1f})")
    ax.set_xticks(range(len(runs)), [name for name, _ in runs], rotation=20, fontsize=7,
                  ha="right")
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title(f"48-layer qwen3-30b-a3b q8_0, resident, {card} ({sha})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(ROOT / f"docs/img/resident_{sha}.png", dpi=120)
    plt.close(fig)


def peer_sitting_plot(sha: str = "fca7a5f", file: str = "qwen3-30b-a3b-48l",
                      title: str = "48-layer qwen3-30b-a3b q8_0") -> None:
    """Every strategy and variant of one sitting's peer runs on ``file`` (several calls on one
    warm machine), beside llama.cpp's offloaded placements; resident is left out (its scale
    is the all-on-GPU one)."""
    runs = []
    llama: dict[str, float] = {}
    ncmoe = 42
    gpu = "H200"
    for f in sorted((ROOT / "benchmarks/results").glob(f"peer_gpu-{file}-*.json")):
        peer = json.loads(f.read_text())
        if not str(peer.get("sha", "")).startswith(sha) or (
                "skew" in str(peer.get("label")) and "skew" not in file):
            continue
        llama = llama or {k: v["tokens_per_s"] for k, v in peer["llamacpp"].items()}
        ncmoe = peer["llamacpp"].get("ncmoe", {}).get("n_cpu_moe", ncmoe)
        gpu = "H100" if "H100" in str(peer.get("gpu")) else gpu
        runs += [(r["strategy"], r["tokens_per_s"]) for r in peer["strategies"]
                 if not r["strategy"].startswith("resident") and r["tokens_per_s"]]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(8, 3.4))
    colors = ["#3a6ea5" if name.startswith(("hybrid", "auto")) else "#6a9955"
              if name.startswith("cpu") else "#888888" for name, _ in runs]
    ax.bar(range(len(runs)), [t for _, t in runs], color=colors)
    for key, label, color in (("ncmoe", f"llama.cpp -ncmoe {ncmoe}", "#aa3333"),
                              ("ot_cpu", "llama.cpp -ot exps=CPU", "#d08770")):
        ax.axhline(llama[key], color=color, ls="--", label=f"{label} ({llama[key]:.1f})")
    ax.set_xticks(range(len(runs)), [name for name, _ in runs], rotation=25, fontsize=7,
                  ha="right")
    ax.set_ylabel("decode tok/s (temperature 1)")
    ax.set_title(f"{title}, 4 GB expert cache, 15 threads, {gpu} ({sha})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = sha if file == "qwen3-30b-a3b-48l" else f"{file}_{sha}"
    fig.savefig(ROOT / f"docs/img/peer_{name}.png", dpi=120)
    plt.close(fig)


def generate_plot() -> None:
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks/results").glob(
        "generate-*.json"))]
    if not runs:
        return
    labels = [f"{r['label']}\n{r['gpu'] or r['cpu'][:24]}" for r in runs]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    y = range(len(runs))
    ax.barh(y, [r["roofline_tokens_per_s"] for r in runs], color="#dddddd",
            label="roofline (copy bandwidth / active bytes per token)")
    ax.barh(y, [r["decode_tokens_per_s"] for r in runs], color="#3a6ea5", label="measured")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(1, 1.5 * max(r["roofline_tokens_per_s"] for r in runs))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("decode tokens/s (batch 1)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/generate.png", dpi=120)


def serve_plot() -> None:
    latest: dict[str, dict] = {}
    for p in sorted((ROOT / "benchmarks/results").glob("serve-*.json")):
        r = json.loads(p.read_text())
        latest[r["label"]] = r  # files sort by time: the last one per label wins
    if not latest:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    for label, r in latest.items():
        c = [lv["concurrency"] for lv in r["levels"]]
        a.plot(c, [lv["output_tokens_per_s"] for lv in r["levels"]], "o-", label=label)
        b.plot(c, [lv["itl_median_s"] * 1e3 for lv in r["levels"]], "o-", label=label)
    a.set_xlabel("concurrent clients")
    a.set_ylabel("output tokens/s")
    b.set_xlabel("concurrent clients")
    b.set_ylabel("median inter-token latency (ms)")
    a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/serve.png", dpi=120)


def decode_moe_plot() -> None:
    """Decode tok/s per strategy on the gemma4-26b-a4b geometry, one group per milestone run,
    next to the run's link roofline (PCIe for offload, overlapped CPU + PCIe for hybrid) and,
    where resident ran too, the serial ceiling (resident step + link time)."""
    milestones = {"838f973": "eager", "5e660ec": "graph pieces", "2838117": "+ fused q8_0",
                  "1d33697": "+ slot tables", "2366cc2": "+ pinned plan",
                  "59974b4": "+ Triton q8_0 slots", "ccac19d": "+ slot ring"}
    paths = sorted((ROOT / "benchmarks/results").glob("decode_moe-gemma4-*.json"),
                   key=lambda p: int(p.stem.rsplit("-", 1)[1]))  # in the order they ran
    runs = [r for r in (json.loads(p.read_text()) for p in paths) if r["sha"] in milestones]
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(11, 3.8))
    labels, measured, ceilings, serial = [], [], [], []
    for r in runs:
        for s in r["strategies"]:
            if "decode_tokens_per_s" not in s or s["strategy"] == "resident":
                continue
            labels.append(f"{s['strategy']}\n{milestones[r['sha']]}")
            measured.append(s["decode_tokens_per_s"])
            ceilings.append(s.get("hybrid_roofline_tokens_per_s")
                            or s.get("pcie_roofline_tokens_per_s") or 0)
            serial.append(s.get("hybrid_serial_ceiling_tokens_per_s")
                          or s.get("pcie_serial_ceiling_tokens_per_s"))
    x = list(range(len(labels)))
    ax.bar(x, ceilings, color="#dddddd", label="link roofline of the same run")
    ax.bar(x, measured, color="#3a6ea5", label="measured")
    pts = [(i, v) for i, v in zip(x, serial, strict=True) if v]
    if pts:
        ax.scatter([i for i, _ in pts], [v for _, v in pts], marker="_", s=200, color="black",
                   label="serial ceiling (resident step + link time)")
    ax.set_xticks(x, labels, fontsize=6, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.set_ylim(5, 400)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "docs/img/decode_moe.png", dpi=120)


if __name__ == "__main__":
    generate_plot()
    serve_plot()
    decode_moe_plot()
    resident_gpu_plot()
    lookahead_plot()
    peer_48l_plot()
    peer_sitting_plot()
    peer_sitting_plot("99ab718")
    peer_sitting_plot("eca228c")
    peer_sitting_plot("43d3cf3")
    peer_sitting_plot("d4e7cd0")
    peer_sitting_plot("62b52bb")
    peer_sitting_plot("e2f4c22")
    peer_sitting_plot("31231cc")
    peer_sitting_plot("a42b429")
    peer_sitting_plot("f88b0bf")
    peer_sitting_plot("001e201")
    peer_sitting_plot("a9b9a4b")
    peer_sitting_plot("ba5d48c")
    # at ba5d48c the token kernels were the default and +pairgemv the pair kernels
    resident_sitting_plot("ba5d48c", names={"resident": "token kernels (then the default)",
                                            "resident+pairgemv": "pair kernels (now)"})
    peer_sitting_plot("5386f2a")
    resident_sitting_plot("5386f2a")
    peer_sitting_plot("f51bd7f")
    resident_sitting_plot("f51bd7f", names={
        "resident": "file blocks, dense dequantised (old default)",
        "resident+regrouped": "regrouped, x as int8",
        "resident+regrouped+denseblocks": "+ dense blocks (new default)"})
    peer_sitting_plot("a9b9a4b", "qwen3-30b-a3b-48l-skew",
                      "48-layer qwen3-30b-a3b q8_0, skewed router")
    peer_sitting_plot("5386f2a", "qwen3-30b-a3b-48l-skew",
                      "48-layer qwen3-30b-a3b q8_0, skewed router")
    peer_sitting_plot("e2f4c22", "gemma4-26b-a4b-30l", "gemma4-26b-a4b (29 q8_0 + 1 bf16 layers)")
    peer_sitting_plot("7ac4c70", "gemma4-26b-a4b-30l", "gemma4-26b-a4b (29 q8_0 + 1 bf16 layers)")
    peer_sitting_plot("7ac4c70", "gemma4-26b-a4b-mxfp4-30l", "gemma4-26b-a4b mxfp4")
    peer_sitting_plot("e59c795", "gemma4-26b-a4b-nvfp4-30l", "gemma4-26b-a4b nvfp4")
    hybrid_vs_offload_plot()
    split_runs_plot()
    small_box_plot()
    small_box_plot("a42b429")
    decode_check_plot()
    prefetch_share_plot()
    timeline_plot("4340331")
