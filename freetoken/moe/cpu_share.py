"""The CPU's share of a hybrid layer call: submitted to the pool from the call's inputs on any
device (:func:`submit_share`), left running while the device computes the rest, and collected
later (``HybridExperts._finish``); what the layer keeps between a call's plan and its
collection (:class:`Pending`, :class:`Calls`), and the pinned buffer that brings the CPU's
result to the device without waiting for the stream (:meth:`Calls.to_device`).

Threads: the engine's main thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.gpu_wait import to_host
from freetoken.cpu.jobs import CpuMoeFuture, JobLog
from freetoken.moe.host_steps import HostCopies
from freetoken.moe.stats import Span


@dataclass(frozen=True)
class Pending:
    """A planned call whose CPU share is still running: what ``HybridExperts._finish`` needs
    to collect it and record the call."""

    x: torch.Tensor
    fetched: int
    on_cpu: int
    fetch: Span | None
    future: CpuMoeFuture | None
    overhead: float
    host: HostCopies | None
    split: bool  # a split's call, whose times the split's model learns from


class Calls:
    """A layer's state between its calls: the last call's times for the policy, the planned
    call whose CPU share is running, the pinned buffer of the CPU's result (eager CUDA), the
    CPU share's timed jobs, whether the slot table on the device is empty."""

    def __init__(self) -> None:
        self.last: tuple[int, float, int, Span | None, float] | None = None
        self.pending: Pending | None = None
        self.staged: torch.Tensor | None = None
        self.jobs = JobLog()  # the CPU share's jobs, with the pool's timing on
        self.table_empty = False  # the device's slot table was last published empty

    def to_device(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The CPU's result in ``x``'s dtype on its device, through the pinned buffer: it is
        rewritten only at the layer's next call, after the host has synced on that call's
        routed ids, so the copy need not be waited for."""
        if not x.is_cuda:
            return out.to(dtype=x.dtype)
        T, H = out.shape
        if self.staged is None or self.staged.shape[0] < T:
            self.staged = torch.empty(max(T, 16), H, dtype=x.dtype, pin_memory=True)
        staged = self.staged[:T]
        staged.copy_(out)
        return staged.to(x.device, non_blocking=True)


def submit_share(executor: cx.CpuMoeExecutor | None, x: torch.Tensor, ids: torch.Tensor,
                 w: torch.Tensor, cpu_ids: torch.Tensor, layer: int) -> CpuMoeFuture:
    """The pairs ``cpu_ids`` (of ``ids``' shape once viewed; -1: not the CPU's) of layer
    ``layer`` on the pool, from x and w on any device; returns at once."""
    assert executor is not None
    if x.is_cuda:  # one transfer (one sync) for both
        both = to_host(torch.cat([x.float(), w.float()], dim=1))
        x, w = both[:, :x.shape[1]], both[:, x.shape[1]:]
    return executor.submit(x, cpu_ids.view(ids.shape), w, layer)
