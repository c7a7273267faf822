"""Programmatic dependent launch (``kernels/build.py:overlap``, FREETOKEN_GPU_PDL): when the
kernels take it, and that it changes only when a kernel starts, never what it computes. Each
kernel's wait ahead of its first global read is checked in its compile test (``pdl=``)."""

from __future__ import annotations

import pytest
import torch

from freetoken.errors import ConfigError
from freetoken.kernels.build import overlap
from tests.engine.graph_helpers import graph_logits, tiny_q8


def test_never_on_the_cpu_nor_when_off(monkeypatch):
    monkeypatch.setenv("FREETOKEN_GPU_PDL", "off")
    assert overlap(torch.device("cuda", 0)) == {}
    monkeypatch.delenv("FREETOKEN_GPU_PDL")  # on by default, but not on the CPU
    assert overlap(torch.device("cpu")) == {}
    monkeypatch.setenv("FREETOKEN_GPU_PDL", "on")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter has no such launch
    assert overlap(torch.device("cuda", 0)) == {}


def test_an_unknown_setting_is_named(monkeypatch):
    monkeypatch.setenv("FREETOKEN_GPU_PDL", "yes")
    with pytest.raises(ConfigError, match="FREETOKEN_GPU_PDL='yes' is not one of on, off"):
        overlap(torch.device("cuda", 0))


@pytest.mark.cuda
@pytest.mark.parametrize("router", ["matmul", "fused"])
@pytest.mark.parametrize("strategy", ["resident", "offload", "hybrid", "cpu"])
def test_decode_graphs_give_the_same_bits_with_overlapped_launches(tmp_path, monkeypatch,
                                                                   strategy, router):
    """A decode through the step's graphs with every Triton kernel launched to overlap the one
    before gives the logits of plain launches, bit for bit (the same kernels, the same
    order of sums: only when they start differs); so with the router's matmul in the
    routing kernel (FREETOKEN_GPU_ROUTER=fused, whose counters it then holds)."""
    from freetoken.kernels.token_steps import _COUNTS

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or above")
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    monkeypatch.setenv("FREETOKEN_GPU_ROUTER", router)
    _COUNTS.clear()
    model = tiny_q8(tmp_path)
    logits = {}
    for pdl in ("off", "on"):
        monkeypatch.setenv("FREETOKEN_GPU_PDL", pdl)
        logits[pdl] = graph_logits(model, strategy, lambda runner, pdl=pdl: _overlaps(pdl))
    assert torch.equal(logits["on"], logits["off"])
    assert bool(_COUNTS) == (router == "fused")


def _overlaps(pdl: str) -> None:
    assert bool(overlap(torch.device("cuda"))) == (pdl == "on")
