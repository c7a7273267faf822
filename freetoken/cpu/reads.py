"""The CPU pool's reads without compute: the stream-read ceiling (``ft bench bw``, the CPU
benchmarks) and warm reads, experts read into the CPU's caches ahead of the job that needs them
(``moe/cpu_warm.py``). A part of :class:`~freetoken.cpu.executor.CpuMoeExecutor`, which holds
the pool, its job slots and the library handle these methods use."""

from __future__ import annotations

import ctypes
from functools import cached_property
from typing import Any

import torch

from freetoken.cpu.library import MAX_IN_FLIGHT


class Reads:
    """Reads on the pool (mixed into the executor; a warm read takes one of its job slots)."""

    _lib: Any
    _handle: Any
    _in_flight: int

    def stream_read_seconds(self, buf: torch.Tensor, reps: int = 1) -> float:
        """Seconds for the workers to read ``buf`` ``reps`` times (the bandwidth ceiling)."""
        return float(
            self._lib.ft_stream_read(
                self._handle, buf.data_ptr(), buf.numel() * buf.element_size(), reps
            )
        )

    def warm(self, layer: int, experts: torch.Tensor) -> bool:
        """Read ``experts`` of ``layer`` (int32, contiguous, the likeliest first; at most
        :attr:`warm_max`) into the CPU's caches on the pool, returning at once: for a job that
        follows soon (a decode step's next layer, predicted). The next job submitted cancels
        what is left of the read; outputs do not change. False, and nothing read, while no pool
        slot is free for it (jobs in flight hold them all but the one it needs)."""
        if experts.dtype is not torch.int32 or not experts.is_contiguous() or experts.is_cuda:
            raise ValueError("warm takes a contiguous int32 CPU tensor of expert ids")
        if self._in_flight >= MAX_IN_FLIGHT - 1:
            return False
        rc = self._lib.ft_warm(self._handle, layer, experts.data_ptr(), experts.numel())
        if rc < 0:
            what = {-1: f"layer {layer} is not on the pool",
                    -2: f"an expert id is outside layer {layer}'s experts",
                    -3: f"{experts.numel()} experts are more than {self.warm_max}"}[rc]
            raise ValueError(f"warm: {what}")
        return True

    @cached_property
    def warm_max(self) -> int:
        """Experts one :meth:`warm` reads at most (the library's constant, asked once: a
        decode step's host steps read it every layer)."""
        return int(self._lib.ft_warm_max())

    def warm_stats(self) -> tuple[int, int]:
        """Warm reads made and the weight bytes they have read."""
        buf = (ctypes.c_int64 * 2)()
        self._lib.ft_warm_stats(self._handle, buf)
        return int(buf[0]), int(buf[1])
