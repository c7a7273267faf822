"""A captured piece of a decode step launched through the CUDA driver (``cuGraphLaunch`` on the
current stream), not through torch's ``CUDAGraph.replay``.

torch's replay first refills the seed and offset of every random generator the capture saw
(two small fills on the stream, launched through its dispatcher) and asks the driver's version:
about 17 us of the host's time per replay on an H100, twice per offloaded layer in a step in
pieces, and the fills on the GPU's path too. The pieces of a decode step draw no random numbers
(sampling runs after the step), so their seeds need no refill; the last piece, which ends with
the head, still goes through torch's replay, and so do steps in one graph.

``FREETOKEN_GRAPH_LAUNCH=torch`` keeps torch's replay for every piece (the twin).

Threads: the engine's main thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache

import torch

from freetoken import env
from freetoken.cpu.row_copy import DRIVER, current_stream


class GraphLaunchError(RuntimeError):
    """The CUDA driver refused to launch a captured piece; the message has its error code."""


@cache
def _driver_launch() -> Callable[[int, int], int] | None:
    """The driver's ``cuGraphLaunch`` (None where it does not load)."""
    try:
        fn = ctypes.CDLL(DRIVER).cuGraphLaunch
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_void_p), ctypes.c_int
    return fn


def launchers(pieces: list[torch.cuda.CUDAGraph]) -> list[Callable[[], None]]:
    """One launch per piece: the driver's for every piece but the last where
    FREETOKEN_GRAPH_LAUNCH allows and the driver and torch expose what it needs, else torch's
    replay."""
    fn = _driver_launch() if env.graph_launch() == "driver" else None
    raw = getattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec", None)
    if fn is None or raw is None:
        return [p.replay for p in pieces]
    return [_DriverLaunch(fn, p) for p in pieces[:-1]] + [pieces[-1].replay]


class _DriverLaunch:
    """``cuGraphLaunch`` of one captured piece on the current stream of its device."""

    __slots__ = ("fn", "exec", "device", "piece")

    def __init__(self, fn: Callable[[int, int], int], piece: torch.cuda.CUDAGraph) -> None:
        self.fn, self.piece = fn, piece  # the piece keeps its executable graph alive
        self.exec = int(piece.raw_cuda_graph_exec())
        self.device = torch.cuda.current_device()

    def __call__(self) -> None:
        err = self.fn(self.exec, current_stream(self.device))
        if err:
            raise GraphLaunchError(f"cuGraphLaunch of a decode piece failed: CUDA driver error "
                                   f"{err} (FREETOKEN_GRAPH_LAUNCH=torch launches through "
                                   "torch's replay)")
