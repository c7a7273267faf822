"""Decode pieces launched through the CUDA driver (``engine/graph_launch.py``) against torch's
replay, their twin: the same kernels in the same order, so the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from freetoken import env
from freetoken.errors import ConfigError
from tests.engine.graph_helpers import graph_logits, tiny_q8


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
    from freetoken.engine.graph_launch import _DriverLaunch

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    model = tiny_q8(tmp_path)
    logits = {}
    for launch in ("torch", "driver"):
        monkeypatch.setenv("FREETOKEN_GRAPH_LAUNCH", launch)

        def launched_by(runner, launch=launch):
            split = runner.graphs.graphs[1].split
            assert split is not None and len(split.pieces) > 1
            driven = [isinstance(f, _DriverLaunch) for f in split.launch]
            assert driven == ([True] * (len(split.pieces) - 1) + [False] if launch == "driver"
                              else [False] * len(split.pieces))

        logits[launch] = graph_logits(model, strategy, launched_by)
    assert not _DriverLaunch.refused
    assert torch.equal(logits["driver"], logits["torch"])
