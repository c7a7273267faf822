"""Decode through a runner's CUDA graphs on the tiny synthetic q8_0 file: what the tests that
compare two ways of running the same graphs (launches, kernel overlap) share."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from freetoken.config import CacheSizing

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9]


def tiny_q8(tmp_path: Path) -> Path:
    """``ft synth --preset tiny --expert-format q8_0`` into ``tmp_path``."""
    model = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)
    return model


def graph_logits(model: Path, strategy: str,
                 check: Callable[[Any], None] | None = None) -> torch.Tensor:
    """The logits of :data:`IDS` decoded one token a step through ``strategy``'s decode graphs
    (5 cache slots, one CPU thread, a fixed split), on the host; ``check`` sees the runner
    first."""
    from freetoken.config import EngineConfig
    from freetoken.engine.runner import ModelRunner
    from freetoken.layers.context import Segment

    cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                       moe_strategy=strategy, max_seq_len=256, cuda_graph_max_bs=4,
                       moe_cpu_threads=1, moe_cache=CacheSizing("size", 5),
                       moe_hybrid_max_fetch=1, moe_hybrid_online=False)
    runner = ModelRunner(cfg, kv_tokens=512, progress=False)
    assert runner.graphs is not None
    if check is not None:
        check(runner)
    pages = runner.kv.allocate(runner.pages_for(len(IDS)))
    logits = torch.cat([runner.forward([[t]], [Segment(pages, i, 1)]).float().cpu()
                        for i, t in enumerate(IDS)])
    del runner
    torch.cuda.empty_cache()
    return logits
