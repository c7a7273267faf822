"""CPU-only decode and prefill against llama.cpp on the same GGUF file and thread count, in one
run.

Both decode greedily from the same prompt ids, one token per step, after a prefill; with
``--prefill-tokens N`` each also prefills an N-token prompt on its own (llama.cpp: one eval of
the prompt, batch N; ours: the engine's prefill of the prompt, up to its first token). llama.cpp
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
from functools import cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import EngineConfig  # noqa: E402
from freetoken.cpu.executor import CpuMoeExecutor  # noqa: E402
from freetoken.engine.engine import Engine, GenerationStats  # noqa: E402
from freetoken.engine.resolve import configure_threads  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402


class LlamaCpp:
    """llama.cpp (llama-cpp-python) on the file, decoding greedily one token per eval."""

    def __init__(self, model: str, threads: int, n_ctx: int = 512) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=n_ctx, n_ubatch=n_ctx, verbose=False)

    def decode(self, ids: list[int], tokens: int) -> dict[str, object]:
        llm, vocab = self.llm, self.llm.n_vocab()
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                           (vocab,))
            out.append(int(logits.argmax()))
            llm.eval([out[-1]])
        dt = time.perf_counter() - t0
        return {"tokens_per_s": tokens / dt, "output_ids": out}

    def prefill(self, ids: list[int]) -> float:
        """Prompt tokens per second of one eval of ``ids`` from an empty context."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t0)


# seconds the engine thread spent in the library: waiting for pool jobs (in which it joins the
# workers), and in native decode layers (their four pool jobs and the steps between them)
_WAITED = {"pool": 0.0, "native_layers": 0.0}
_TIMED = {"ft_wait": "pool", "ft_run": "pool", "ft_run_linear": "pool",
          "ft_decode_layer": "native_layers"}


def _time_waits(ex: object) -> None:
    """Count the time spent in ``ex``'s library calls into _WAITED; installed once per library."""
    lib = ex._lib  # type: ignore[attr-defined]
    if getattr(lib, "_waits_timed", False):
        return
    for name, kind in _TIMED.items():
        inner = getattr(lib, name)

        def timed(*args, _inner=inner, _kind=kind):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                _WAITED[_kind] += time.perf_counter() - t

        setattr(lib, name, timed)
    lib._waits_timed = True


@cache
def _pool(threads: int) -> CpuMoeExecutor:
    """One pool per process, shared by our engines (two would pin workers to the same cores)."""
    pool = CpuMoeExecutor(threads=threads)
    _time_waits(pool)
    return pool


class Ours:
    """Our engine on the file, CPU only; it records how a token's time splits between the
    engine thread's own work and its waits for pool jobs (in which it joins the workers).

    Engines of one run share the process's pool: a later engine's experts replace an earlier
    one's under the same layer ids (the same file's bytes, so the results are the same, but
    the earlier engine then reads the later one's copy)."""

    def __init__(self, model: str, threads: int, strategy: str, cpu_dense: str,
                 join: bool, native: bool, max_len: int = 512) -> None:
        cfg = EngineConfig(model=model, device="cpu", dtype="float32", moe_strategy=strategy,
                           max_seq_len=max_len, moe_cpu_threads=max(1, threads - 1),
                           cpu_dense=cpu_dense)
        configure_threads(cfg)
        self.executor = None
        if strategy == "cpu" or cpu_dense == "pool":
            self.executor = _pool(cfg.moe_cpu_threads)
        self.engine = Engine(cfg, progress=False, pool=self.executor)
        if not native:  # decode every layer through its modules (the native layers' twin)
            for layer in self.engine.model.model.layers:
                layer.native = None
        self.join = join

    def prefill(self, ids: list[int]) -> float:
        """Prompt tokens per second of the engine's prefill of ``ids`` (to its first token)."""
        if self.executor is not None:
            self.executor.set_join(self.join)
        stats = GenerationStats()
        next(self.engine.stream(ids, SamplingParams(max_tokens=1, ignore_eos=True), stats))
        return len(ids) / stats.prefill_s

    def decode(self, ids: list[int], tokens: int) -> dict[str, object]:
        if self.executor is not None:
            self.executor.set_join(self.join)
        stats = GenerationStats()
        steps = self.engine.stream(ids, SamplingParams(max_tokens=tokens + 1, ignore_eos=True),
                                   stats)
        out = [next(steps)]  # the prefill's token
        for k in _WAITED:
            _WAITED[k] = 0.0
        t0 = time.perf_counter()
        out += list(steps)
        total = time.perf_counter() - t0
        return {"tokens_per_s": stats.decode_tokens_per_s, "output_ids": out[:tokens],
                # per decode step: the engine thread's waits for pool jobs outside native
                # layers, its time in native layers, and the rest (Python and torch)
                "pool_wait_ms_per_token": _WAITED["pool"] / tokens * 1e3,
                "native_layers_ms_per_token": _WAITED["native_layers"] / tokens * 1e3,
                "engine_ms_per_token": (total - sum(_WAITED.values())) / tokens * 1e3}


# name: (--moe-strategy, --cpu-dense, whether the engine thread joins pool jobs, whether
# decode layers run as one native call each where they fit, what it is)
ENGINES = {
    "cpu_dense_pool": ("cpu", "pool", True, True,
                       "experts and dense matrices in their format on the pool; a decode "
                       "layer is one native call"),
    "cpu_dense_pool_nojoin": ("cpu", "pool", False, True, "the same, the engine thread only "
                              "waits for pool jobs (CpuMoeExecutor.set_join)"),
    "cpu_dense_pool_modules": ("cpu", "pool", True, False, "the same, each decode layer "
                               "through its torch modules (the native layer's slow twin)"),
    "cpu": ("cpu", "torch", True, True, "experts on the pool, dense layers f32 in torch"),
    "resident_f32": ("resident", "torch", True, True,
                     "everything dequantised to f32 in torch"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="decode runs of each engine, interleaved; the medians are reported")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time the prefill of a prompt of this many tokens (0: none)")
    p.add_argument("--label", default="")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="comma-separated engines of ours to run next to llama.cpp: "
                   + ", ".join(f"{k} ({v[4]})" for k, v in ENGINES.items()))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    engines = args.engines.split(",")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engines {unknown} (choose from {', '.join(ENGINES)})")
    ids = list(range(1000, 1016))
    prompt = [1000 + (7 * i) % 5000 for i in range(args.prefill_tokens)]
    n_ctx = max(512, args.prefill_tokens + 16)
    peer = LlamaCpp(args.model, args.threads, n_ctx)
    ours = {name: Ours(args.model, args.threads, *ENGINES[name][:4], max_len=n_ctx)
            for name in engines}
    runs: dict[str, list[dict[str, object]]] = {"llama_cpp": []} | {n: [] for n in engines}
    engines_of = {"llama_cpp": peer} | ours
    for r in range(args.repeats):  # interleaved, so drift in the machine hits both alike
        for name, engine in engines_of.items():
            run = engine.decode(ids, args.tokens)
            if prompt:
                run["prefill_tokens_per_s"] = engine.prefill(prompt)
            runs[name].append(run)
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{k} {v[-1]['tokens_per_s']:.1f} tok/s" + (
                f" (prefill {v[-1]['prefill_tokens_per_s']:.0f})" if prompt else "")
            for k, v in runs.items()), flush=True)

    def median(xs: list[float]) -> float:
        return float(np.median(xs))

    result: dict[str, object] = {
        "bench": "cpu_peer", "label": args.label,
        **git_state(os.environ.get("GIT_SHA")), **host(),
        "params": vars(args) | {"out": str(args.out)},
    }
    peer_tps = median([run["tokens_per_s"] for run in runs["llama_cpp"]])  # type: ignore[misc]
    result["llama_cpp"] = {"tokens_per_s": peer_tps,
                           "runs": [run["tokens_per_s"] for run in runs["llama_cpp"]]}
    if prompt:
        peer_pp = median([run["prefill_tokens_per_s"] for run in runs["llama_cpp"]])  # type: ignore[misc]
        result["llama_cpp"]["prefill_tokens_per_s"] = peer_pp  # type: ignore[index]
    for name in engines:
        mine = runs[name]
        summary = {k: median([run[k] for run in mine])  # type: ignore[misc]
                   for k in mine[0] if k != "output_ids"}
        summary["runs"] = [run["tokens_per_s"] for run in mine]
        result[f"ours_{name}"] = summary
        result[f"ratio_{name}_to_llama_cpp"] = summary["tokens_per_s"] / peer_tps
        if prompt:
            result[f"prefill_ratio_{name}_to_llama_cpp"] = \
                summary["prefill_tokens_per_s"] / peer_pp
        same = 0
        for a, b in zip(mine[0]["output_ids"], runs["llama_cpp"][0]["output_ids"],  # type: ignore[call-overload]
                        strict=False):
            if a != b:
                break
            same += 1
        result[f"first_tokens_equal_{name}"] = same
    print(json.dumps({k: v for k, v in result.items() if k != "params"}, indent=1)[:2000])
    save_result(args.out, f"cpu_peer-{args.label or 'run'}", result)


if __name__ == "__main__":
    main()
