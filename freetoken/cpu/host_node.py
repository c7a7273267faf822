"""A layer's CPU pool job as a host function of a CUDA graph (``csrc/host_node.cpp``).

Inside a captured decode graph a layer's inputs are copied to pinned memory, the CUDA driver's
host thread runs the pool's job on them (``ft_host_node_run``, queued with the driver's
``cuLaunchHostFunc``; it calls no CUDA API) and the graph copies the result back: the device
waits for the CPU in the stream, and no Python runs between the layers. :meth:`HostNodes.run`
calls the same function on the calling thread, the twin the CPU tests compare with the pool's
own job. The driver's host thread is pinned to the engine thread's core at its first job:
unpinned, it may share a pool worker's core while it joins the job (the workers have the
others), and a worker that loses its core stalls the job.

One :class:`HostNodes` per decode graph: its jobs share a :class:`~abi.HostNodeStep` whose
``rows`` the graph runner sets before each replay (padded rows are not computed), and count
any job the pool refused, which :meth:`HostNodes.check` raises after the replay.

Threads: made and set by the engine's main thread; the jobs run on the driver's host thread
while a replay executes (nothing else writes them then).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from freetoken import env
from freetoken.cpu import abi
from freetoken.cpu.cores import core_plan, usable_cores
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.gpu_wait import GpuWait
from freetoken.cpu.library import native
from freetoken.cpu.row_copy import driver_function


@cache
def launch_host_func() -> ctypes._CFuncPtr | str:
    """The driver's ``cuLaunchHostFunc``, or why there is none."""
    return driver_function("cuLaunchHostFunc", [ctypes.c_void_p] * 3)


class HostNodeError(RuntimeError):
    """The pool refused a job a graph's host node gave it."""


class HostNodes:
    """The host-node jobs of one decode graph and the step they share."""

    def __init__(self) -> None:
        self.lib = native()
        self.step = abi.HostNodeStep(core=-1)
        self.jobs: list[tuple[abi.HostNodeJob, tuple[torch.Tensor, ...]]] = []
        self._run = ctypes.cast(self.lib.ft_host_node_run, ctypes.c_void_p).value
        self._done: GpuWait | None = None  # made by the first wait()
        self._spin_us = 0  # see wait()

    def job(self, executor: CpuMoeExecutor, layer: int, x: torch.Tensor, ids: torch.Tensor,
            w: torch.Tensor, out: torch.Tensor) -> abi.HostNodeJob:
        """Layer ``layer``'s job on pinned ``x`` (T, H) float32, ``ids`` (T, A) int64 and
        ``w`` (T, A) float32, its result in ``out`` (T, H) float32; kept alive here."""
        executor.prepare(x, ids, w, layer, out)  # the checks a prepared job gets
        j = abi.HostNodeJob(executor.handle, x.data_ptr(), ids.data_ptr(), w.data_ptr(),
                            out.data_ptr(), layer, x.shape[0], ids.shape[1], 0,
                            ctypes.pointer(self.step))
        self.jobs.append((j, (x, ids, w, out)))
        return j

    def enqueue(self, job: abi.HostNodeJob, stream: int, piece: int = 0) -> None:
        """``job`` on the driver's host thread after the work queued on ``stream`` so far (a
        host node when the stream is being captured, in the graph's piece ``piece``)."""
        launch = launch_host_func()
        if isinstance(launch, str):
            raise HostNodeError(launch)
        # the driver's host thread runs the jobs on the engine thread's core, which is free
        # while the engine thread waits for the replay asleep (see wait)
        self.step.core = core_plan(usable_cores(), True).engine
        err = launch(stream, self._run, ctypes.addressof(job))
        if err:
            raise HostNodeError(f"cuLaunchHostFunc failed: CUDA driver error {err}")

    def run(self, job: abi.HostNodeJob) -> None:
        """``job`` on the calling thread, as the host node runs it."""
        self.lib.ft_host_node_run(ctypes.addressof(job))

    def serve(self, piece: int) -> None:
        """What the engine thread does for piece ``piece``'s jobs once its replay is
        launched: nothing (the driver's thread runs them)."""

    def release(self) -> None:
        """Let a replay left waiting on its jobs run on: nothing to do (no one waits)."""

    def set_rows(self, n: int) -> None:
        """The live rows of the next replay (the jobs compute no others)."""
        self.step.rows = n

    def wait(self) -> None:
        """Block until the current stream's work so far (a replay holding these jobs) is done,
        asleep on a blocking event: the pool computes meanwhile, and a spin on this thread's
        core in the caller's first sync would take a core from it (so no spin first)."""
        if self._done is None:
            self._done = GpuWait(torch.cuda.current_device(), spin_us=self._spin_us)
        self._done.wait()

    def check(self) -> None:
        """Raise if the pool refused a job since the last check."""
        if self.step.failures:
            code, self.step.failures = self.step.last_error, 0
            raise HostNodeError(f"the CPU pool refused a graph's expert job (code {code}: "
                                "-1 an unknown layer, -2 an expert id out of range)")


def host_nodes() -> str | None:
    """Why decode graphs do not hold the pool's jobs as host nodes (None: they do): they do
    only with ``FREETOKEN_CPU_HOST_NODE=on`` and a driver with host functions. Off by default:
    on the H200 (48-layer qwen3-30b-a3b q8_0, 15 threads) cpu decoded 15.6 tok/s with them
    against 31.4 with a host step between pieces (benchmarks/results, fca7a5f)."""
    if env.cpu_host_node() != "on":
        return "host nodes are off (FREETOKEN_CPU_HOST_NODE=on turns them on)"
    launch = launch_host_func()
    return launch if isinstance(launch, str) else None
