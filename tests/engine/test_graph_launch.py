"""Decode pieces launched through the CUDA driver (``engine/graph_launch.py``) against torch's
replay, their twin: the same kernels in the same order, so the same logits bit for bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from freetoken import env
from freetoken.config import CacheSizing
from freetoken.errors import ConfigError


def test_an_unknown_launch_is_named(monkeypatch):
    monkeypatch.setenv("FREETOKEN_GRAPH_LAUNCH", "cuda")
    with pytest.raises(ConfigError, match="FREETOKEN_GRAPH_LAUNCH='cuda' is not one of driver"):
        env.graph_launch()
    monkeypatch.delenv("FREETOKEN_GRAPH_LAUNCH")
    assert env.graph_launch() == "driver"


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_pieces_launched_by_the_driver_give_torchs_bits(tmp_path, monkeypatch, strategy):
    """A step in pieces (hybrid: with its late steps) launched by ``cuGraphLaunch``, every piece
    but the last, gives the logits of torch's replays; the launches are the driver's."""
    from freetoken.config import EngineConfig
    from freetoken.engine.graph_launch import _DriverLaunch
    from freetoken.engine.runner import ModelRunner
    from freetoken.layers.context import Segment

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    model = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)
    ids = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9]
    logits = {}
    for launch in ("torch", "driver"):
        monkeypatch.setenv("FREETOKEN_GRAPH_LAUNCH", launch)
        cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                           moe_strategy=strategy, max_seq_len=256, cuda_graph_max_bs=4,
                           moe_cpu_threads=1, moe_cache=CacheSizing("size", 5),
                           moe_hybrid_max_fetch=1, moe_hybrid_online=False)
        runner = ModelRunner(cfg, kv_tokens=512, progress=False)
        assert runner.graphs is not None
        split = runner.graphs.graphs[1].split
        assert split is not None and len(split.pieces) > 1
        driven = [isinstance(f, _DriverLaunch) for f in split.launch]
        assert driven == ([True] * (len(split.pieces) - 1) + [False] if launch == "driver"
                          else [False] * len(split.pieces))
        pages = runner.kv.allocate(runner.pages_for(len(ids)))
        logits[launch] = torch.cat([runner.forward([[t]], [Segment(pages, i, 1)]).float().cpu()
                                    for i, t in enumerate(ids)])
        del runner
        torch.cuda.empty_cache()
    assert torch.equal(logits["driver"], logits["torch"])
