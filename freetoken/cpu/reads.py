"""The CPU pool's reads without compute: the stream-read ceiling (``ft bench bw``, the CPU
benchmarks). A part of :class:`~freetoken.cpu.executor.CpuMoeExecutor`, which holds the pool,
its job slots and the library handle it uses."""

from __future__ import annotations

from typing import Any

import torch


class Reads:
    """Reads on the pool (mixed into the executor)."""

    _lib: Any
    _handle: Any

    def stream_read_seconds(self, buf: torch.Tensor, reps: int = 1) -> float:
        """Seconds for the workers to read ``buf`` ``reps`` times (the bandwidth ceiling)."""
        return float(
            self._lib.ft_stream_read(
                self._handle, buf.data_ptr(), buf.numel() * buf.element_size(), reps
            )
        )
