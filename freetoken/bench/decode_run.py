"""``ft bench bw --decode-check``: the model itself decoding on this box, offloaded, hybrid and
cpu, each in a child process of its own (an engine's
pinned banks are not all handed back while its process lives, and a model loaded twice in one
process can outgrow the host). The figures go into the rows as a
:class:`~freetoken.moe.decode_check.DecodeCheck`, which ``--moe-strategy auto`` weighs above the
GB/s.

A child is this module run as ``python -m freetoken.bench.decode_run '<json>'``: it loads the
engine as ``ft serve`` would (the strategy, the cache, the pool's threads, decode CUDA graphs on
a GPU), decodes ``WARMUP`` tokens untimed, then the timed ones at temperature 1 (what chat
clients send) with a fixed seed, and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from freetoken import env
from freetoken.errors import ConfigError

WARMUP = 16  # untimed tokens first: the first steps' graph replays and the pool waking
PROMPT = "Tell me about the history of the printing press and how it changed Europe."
GRAPH_BATCH = 16  # decode graphs up to this batch on a GPU, as `ft serve` captures by default
CHILD_TIMEOUT_S = 3600.0  # a run that takes longer is stuck (a 30 GB file loads in about a minute)


def decode_tokens_per_s(model: str, strategy: str, device: str, threads: int,
                        cache_bytes: int, tokens: int, profile: Path) -> float:
    """Decode tokens a second of ``strategy`` on ``model`` in a child process that reads the
    bandwidth ``profile`` (the rows just benched: hybrid splits by them); ConfigError with the
    child's last lines when it fails."""
    spec = {"model": model, "strategy": strategy, "device": device, "threads": threads,
            "cache_bytes": cache_bytes, "tokens": tokens}
    child_env = {**os.environ, env.BENCHBW_PATH: str(profile)}
    try:
        done = subprocess.run([sys.executable, "-m", "freetoken.bench.decode_run",
                               json.dumps(spec)], capture_output=True, text=True, env=child_env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        tail = " | ".join((said or "").strip().splitlines()[-3:]) or "nothing"
        raise ConfigError(f"the decode check's {strategy} run of {model} did not finish in "
                          f"{CHILD_TIMEOUT_S:g} s and was stopped; its last lines: {tail}") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join((done.stdout + done.stderr).strip().splitlines()[-3:])
        raise ConfigError(f"the decode check's {strategy} run of {model} failed (exit "
                          f"{done.returncode}): {tail}")
    return float(json.loads(lines[-1])["tokens_per_s"])


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One strategy's run (in the child): its decode tokens a second."""
    from freetoken.config import CacheSizing, EngineConfig
    from freetoken.engine.engine import Engine, GenerationStats
    from freetoken.engine.resolve import configure_threads
    from freetoken.engine.sample import SamplingParams

    cuda = spec["device"] == "cuda"
    cfg = EngineConfig(model=spec["model"], device=spec["device"],
                       dtype="bfloat16" if cuda else "float32", moe_strategy=spec["strategy"],
                       max_seq_len=WARMUP + spec["tokens"] + 256,
                       cuda_graph_max_bs=GRAPH_BATCH if cuda else 0,
                       moe_cpu_threads=spec["threads"],
                       moe_cache=CacheSizing("mem", float(spec["cache_bytes"])))
    configure_threads(cfg, pin=True)
    engine = Engine(cfg, progress=False)
    ids = engine.encode(PROMPT)
    sampling = dict(temperature=1.0, seed=0, ignore_eos=True)
    engine.generate(ids, SamplingParams(max_tokens=WARMUP, **sampling))
    stats = GenerationStats()
    engine.generate(ids, SamplingParams(max_tokens=spec["tokens"], **sampling), stats=stats)
    return {"strategy": spec["strategy"], "tokens_per_s": stats.decode_tokens_per_s}


def main(argv: Sequence[str]) -> int:
    print(json.dumps(_child(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
