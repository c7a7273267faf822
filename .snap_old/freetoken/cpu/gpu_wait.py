"""The host waiting for the GPU at the cost of a bounded spin, not of the whole wait.

Under CUDA's default schedule a thread that waits for the device (a stream's or an event's
synchronize, a copy to the host) polls it on its own core until the work is done: a decode
step's whole GPU time on the engine thread's core, which a small or busy box cannot spare.
:class:`GpuWait` records an event made with blocking sync on the stream, polls it for at
most ``spin_us`` microseconds (a short wait stays fast: waking from sleep costs tens of
microseconds) and then sleeps on it. The library's ``ft_wait_event`` does both in one call
through the driver's entry points (as the row copies use them); where the library or the
driver is missing, :meth:`GpuWait.slow` runs the same loop on torch's event (its slow twin).

Threads: one waiter per thread that waits (its event is reused call to call).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import torch

from freetoken.config.engine import MOE_CPU_SPIN_US
from freetoken.cpu.library import NativeUnavailable, native
from freetoken.cpu.row_copy import RowCopyError, current_stream, driver_api


class GpuWait:
    """Waits for the current CUDA stream of ``device``: ``spin_us`` polled, then asleep."""

    def __init__(self, device: int = 0, spin_us: int = MOE_CPU_SPIN_US) -> None:
        self.device, self.spin_us = device, spin_us
        self.event = torch.cuda.Event(blocking=True)
        self.event.record(torch.cuda.current_stream(device))  # made now: it has a handle
        self._lib: Any = None
        self._api: Any = None
        api = driver_api()
        if not isinstance(api, str):
            try:
                self._lib, self._api = native(), ctypes.byref(api)
            except NativeUnavailable:
                pass

    def wait(self) -> None:
        """Return once the work queued on the current stream so far is done."""
        if self._lib is None:
            self.slow()
            return
        err = self._lib.ft_wait_event(self._api, self.event.cuda_event,
                                      current_stream(self.device), self.spin_us)
        if err:
            raise RowCopyError(f"waiting for the GPU failed: CUDA driver error {err}")

    def slow(self) -> None:
        """:meth:`wait` in Python on torch's event: the same spin, then the same sleep."""
        self.event.record(torch.cuda.current_stream(self.device))
        until = time.perf_counter() + self.spin_us / 1e6
        while not self.event.query():
            if time.perf_counter() >= until:
                self.event.synchronize()
                return

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host, after a :meth:`wait` for the work that makes it (the copy that
        follows then finds it done; a CPU tensor is returned as it is)."""
        if t.is_cpu:
            return t
        self.wait()
        return t.cpu()


_WAITS: dict[tuple[int, int], GpuWait] = {}


def gpu_wait(device: torch.device | int | None = None) -> GpuWait:
    """The calling thread's waiter for ``device`` (default: the current one)."""
    index = device if isinstance(device, int) else (
        device.index if isinstance(device, torch.device) and device.index is not None
        else torch.cuda.current_device())
    key = (threading.get_ident(), index)
    w = _WAITS.get(key)
    if w is None:
        w = _WAITS[key] = GpuWait(index)
    return w


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host; a GPU tensor waited for with the thread's :class:`GpuWait`."""
    return t if t.is_cpu else gpu_wait(t.device).to_host(t)
