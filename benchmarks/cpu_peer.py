"""CPU-only decode against llama.cpp on the same GGUF file and thread count, in one run.

Both decode greedily from the same prompt ids, one token per step, after a prefill. llama.cpp
runs with --threads T; we run with T cores in all: T-1 CPU expert workers (at least 1) plus the
engine thread, with the dense layers in torch (`--cpu-dense torch`) or in their own format on
the pool, where the engine thread joins the workers while it waits (`--cpu-dense pool`).

    python benchmarks/cpu_peer.py --model qwen3-4layers-q8_0.gguf --threads 2 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine, GenerationStats  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402
from freetoken.resolve import configure_threads  # noqa: E402


def llamacpp_decode(model: str, ids: list[int], tokens: int, threads: int) -> dict[str, float]:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    vocab = llm.n_vocab()
    llm.eval(ids)
    out: list[int] = []
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (vocab,))
        out.append(int(logits.argmax()))
        llm.eval([out[-1]])
    dt = time.perf_counter() - t0
    return {"tokens_per_s": tokens / dt, "output_ids": out}


def ours_decode(model: str, ids: list[int], tokens: int, threads: int,
                strategy: str, cpu_dense: str = "torch", join: bool = True) -> dict[str, object]:
    cfg = EngineConfig(model=model, device="cpu", dtype="float32", moe_strategy=strategy,
                       max_seq_len=512, moe_cpu_threads=max(1, threads - 1),
                       cpu_dense=cpu_dense)
    configure_threads(cfg)
    engine = Engine(cfg, progress=False)
    if strategy == "cpu" or cpu_dense == "pool":
        from freetoken.moe.cpu import shared_executor

        shared_executor().set_join(join)
    stats = GenerationStats()
    out = engine.generate(ids, SamplingParams(max_tokens=tokens + 1, ignore_eos=True),
                          stats=stats)
    return {"tokens_per_s": stats.decode_tokens_per_s, "output_ids": out[:tokens]}


# name: (--moe-strategy, --cpu-dense, whether the engine thread joins pool jobs, what it is)
ENGINES = {
    "cpu_dense_pool": ("cpu", "pool", True,
                       "experts and dense matrices in their format on the pool"),
    "cpu_dense_pool_nojoin": ("cpu", "pool", False, "the same, the engine thread only waits "
                              "for pool jobs (CpuMoeExecutor.set_join)"),
    "cpu": ("cpu", "torch", True, "experts on the pool, dense layers f32 in torch"),
    "resident_f32": ("resident", "torch", True, "everything dequantised to f32 in torch"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--label", default="")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated engines of ours to run next to llama.cpp: "
                   + ", ".join(f"{k} ({v[3]})" for k, v in ENGINES.items()))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engines {unknown} (choose from {', '.join(ENGINES)})")
    ids = list(range(1000, 1016))
    peer = llamacpp_decode(args.model, ids, args.tokens, args.threads)
    result: dict[str, object] = {
        "bench": "cpu_peer", "label": args.label,
        **git_state(os.environ.get("GIT_SHA")), **host(),
        "params": vars(args) | {"out": str(args.out)},
        "llama_cpp": peer,
    }
    for name in engines:
        strategy, dense, join, _ = ENGINES[name]
        ours = ours_decode(args.model, ids, args.tokens, args.threads, strategy, dense, join)
        result[f"ours_{name}"] = ours
        result[f"ratio_{name}_to_llama_cpp"] = ours["tokens_per_s"] / peer["tokens_per_s"]  # type: ignore[operator]
        same = 0
        for a, b in zip(ours["output_ids"], peer["output_ids"], strict=False):  # type: ignore[call-overload]
            if a != b:
                break
            same += 1
        result[f"first_tokens_equal_{name}"] = same
    print(json.dumps({k: v for k, v in result.items() if k != "params"}, indent=1)[:2000])
    save_result(args.out, f"cpu_peer-{args.label or 'run'}", result)


if __name__ == "__main__":
    main()
