"""A layer's CPU share between decode graph pieces: the pool's job on the pinned host copies of
the layer's inputs (:class:`~freetoken.moe.host_steps.HostCopies`), checked once per set of copies
and then submitted call after call without the checks or a copy in between.

Used by every strategy whose experts the pool computes while decode graphs replay (hybrid's
misses it does not fetch, cpu's every routed expert). Threads: the engine's main thread only.
"""

from __future__ import annotations

import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.jobs import CpuMoeFuture
from freetoken.moe.host_steps import HostCopies


class HostJob:
    """The pool's job on one set of host copies: its ids buffer, float32 copies of x and w
    where the host copies are of another dtype, and the executor's prepared jobs, whose result
    the pool writes into ``host.cpu_out``: one on its own ids (a caller's choice of pairs; the
    host copies keep the routed ids the plan read), one on the routed ids in place (every
    pair: nothing copied)."""

    def __init__(self, executor: cx.CpuMoeExecutor, layer: int, host: HostCopies) -> None:
        self.host = host
        self.x = host.x if host.x.dtype is torch.float32 else torch.empty(
            host.x.shape, dtype=torch.float32)
        self.w = host.w if host.w.dtype is torch.float32 else torch.empty(
            host.w.shape, dtype=torch.float32)
        self.ids = torch.empty(host.ids.shape, dtype=torch.int64)  # a caller may fill them
        self.job = executor.prepare(self.x, self.ids, self.w, layer, host.cpu_out)
        self.every_pair = (executor.prepare(self.x, host.ids, self.w, layer, host.cpu_out)
                           if host.ids.dtype is torch.int64 and host.ids.is_contiguous()
                           else None)
        self.executor = executor

    def submit(self, all_pairs: bool, signal: int = 0) -> CpuMoeFuture:
        """The job on the host copies' current values: every routed pair (``all_pairs``), or
        the pairs a caller wrote into :attr:`ids` (-1: a pair that is not the CPU's).
        ``signal``: a flag the pool sets once ``host.cpu_out`` is written (``host.cpu_done``)."""
        return self.executor.submit_prepared(self._filled(all_pairs), signal)

    def run(self) -> float:
        """Every routed pair, submitted and waited for in one call into the library (the
        calling thread joins the job); the pool's seconds on it. The result is in
        ``host.cpu_out``."""
        return self.executor.run_prepared(self._filled(all_pairs=True))

    def _filled(self, all_pairs: bool) -> cx.PreparedJob:
        """The prepared job to run, its buffers filled from the host copies."""
        if self.x is not self.host.x:
            self.x.copy_(self.host.x)
        if self.w is not self.host.w:
            self.w.copy_(self.host.w)
        if not all_pairs:
            return self.job
        if self.every_pair is not None:
            return self.every_pair
        self.ids.copy_(self.host.ids)
        return self.job


class HostJobs:
    """One layer's :class:`HostJob` per set of host copies (a decode graph per batch size,
    each with its own pinned buffers and row counts)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self._jobs: dict[tuple[int, int], HostJob] = {}

    def get(self, executor: cx.CpuMoeExecutor, host: HostCopies) -> HostJob:
        """``host``'s job (made at its first call)."""
        key = (host.x.data_ptr(), host.x.shape[0])
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = HostJob(executor, self.layer, host)
        return job
