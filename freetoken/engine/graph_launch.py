"""A captured piece of a decode step launched through the CUDA driver (``cuGraphLaunch`` on the
current stream), not through torch's ``CUDAGraph.replay``.

A replay took 17.5 us of the host's time (median, one H100, ``benchmarks/step_timeline.py``
at 4340331), twice per hybrid layer in a step in pieces. Before its launch, torch's replay
refills the seed and offset of the random generators the capture registered (two small fills
on the stream, through its dispatcher) and asks the driver's version. The pieces of a decode
step draw no random numbers (sampling runs after the step), so their seeds need no refill; the
last piece, which ends with the head, still goes through torch's replay, and so do steps in
one graph. The driver's launch has not been timed on a GPU yet.

``FREETOKEN_GRAPH_LAUNCH=torch`` keeps torch's replay for every piece (the twin). Where the
driver refuses a launch, the piece and every later launch go through torch's replay, with a
warning that names the error.

Threads: the engine's main thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import cache

import torch

from freetoken import env
from freetoken.cpu.row_copy import current_stream, driver_function

log = logging.getLogger(__name__)


@cache
def _driver_launch() -> Callable[[int, int], int] | None:
    """The driver's ``cuGraphLaunch`` (None where it does not load)."""
    fn = driver_function("cuGraphLaunch", [ctypes.c_void_p] * 2)
    return None if isinstance(fn, str) else fn


def launchers(pieces: list[torch.cuda.CUDAGraph]) -> list[Callable[[], None]]:
    """One launch per piece: the driver's for every piece but the last where
    FREETOKEN_GRAPH_LAUNCH allows and the driver and torch expose what it needs, else torch's
    replay."""
    fn = _driver_launch() if env.graph_launch() == "driver" else None
    raw = getattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec", None)
    if fn is None or raw is None:
        return [p.replay for p in pieces]
    try:
        return [_DriverLaunch(fn, p) for p in pieces[:-1]] + [pieces[-1].replay]
    except RuntimeError as e:  # torch keeps no executable graph to hand out
        log.warning("decode pieces are launched through torch's replay (%s)", e)
        return [p.replay for p in pieces]


class _DriverLaunch:
    """``cuGraphLaunch`` of one captured piece on the current stream of its device."""

    __slots__ = ("fn", "exec", "device", "piece")
    refused = False  # the driver refused a launch: every piece goes through torch's replay

    def __init__(self, fn: Callable[[int, int], int], piece: torch.cuda.CUDAGraph) -> None:
        self.fn, self.piece = fn, piece  # the piece keeps its executable graph alive
        self.exec = int(piece.raw_cuda_graph_exec())
        self.device = torch.cuda.current_device()

    def __call__(self) -> None:
        if _DriverLaunch.refused:
            self.piece.replay()
            return
        err = self.fn(self.exec, current_stream(self.device))
        if err:  # nothing was launched: the piece goes through torch's replay instead
            _DriverLaunch.refused = True
            log.warning("the CUDA driver refused to launch a decode piece (cuGraphLaunch: "
                        "error %d); pieces are launched through torch's replay from now on, "
                        "about 17 us more of the host's time each", err)
            self.piece.replay()
