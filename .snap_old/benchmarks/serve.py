"""Serving latency and throughput against a running `ft serve`, at several concurrencies.

For each concurrency c, c clients each send `--requests` streaming completions back to back;
TTFT is the time to the first streamed token, ITL the time between later tokens, throughput
the output tokens of all clients over the wall time. The scaling column compares throughput with
concurrency 1 measured in the same run.

    ft serve --model M &   python benchmarks/serve.py --url http://127.0.0.1:1919
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402

PROMPTS = ["The history of computing", "Once upon a time", "def quicksort(xs):",
           "The best way to learn a language is", "In 1969, the first", "Dear team,",
           "Photosynthesis is", "The rules of chess"]


def one_request(url: str, prompt: str, max_tokens: int) -> dict[str, object]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - t0, "itl": gaps, "tokens": len(stamps)}


def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency * requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(url, p, max_tokens), jobs))
    wall = time.perf_counter() - t0
    itl = [g for r in results for g in r["itl"]]  # type: ignore[union-attr]
    ttft = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)  # type: ignore[misc]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(ttft), "ttft_p90_s": _p90(ttft),
            "itl_median_s": statistics.median(itl), "itl_p90_s": _p90(itl)}


def _p90(xs: list) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:1919")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    info = httpx.get(f"{args.url}/v1/stats", timeout=10).json()
    one_request(args.url, "warm up", 4)
    levels = [run_level(args.url, int(c), args.requests, args.max_tokens)
              for c in args.concurrency.split(",")]
    for lv in levels:
        lv["scaling_vs_c1"] = lv["output_tokens_per_s"] / levels[0]["output_tokens_per_s"]
        print(f"c={lv['concurrency']}: {lv['output_tokens_per_s']:.1f} tok/s "
              f"(x{lv['scaling_vs_c1']:.2f}), TTFT {lv['ttft_median_s'] * 1e3:.0f} ms, "
              f"ITL {lv['itl_median_s'] * 1e3:.1f} ms")
    result = {"bench": "serve", "label": args.label, **git_state(args.git_sha), **host(),
              "server": info, "params": vars(args) | {"out": str(args.out)}, "levels": levels}
    save_result(args.out, f"serve-{args.label or 'run'}", result)


if __name__ == "__main__":
    main()
