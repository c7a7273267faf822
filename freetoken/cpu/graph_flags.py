"""A decode graph's CPU pool jobs served on flags in pinned memory (``csrc/graph_flags.cpp``).

Host nodes (:mod:`.host_node`) hand each layer's job to the CUDA driver's host thread. Here
the graph signals the engine thread instead: once a layer's inputs are copied to pinned
memory the stream writes that job's go flag (``cuStreamWriteValue32``, ordered after the
copies) and waits in the stream for its done flag (``cuStreamWaitValue32``) before it copies
the result back. The engine thread, which launched the replay, serves a piece's jobs in order
in one library call (:meth:`FlagJobs.serve`): it polls a job's go flag (a bounded spin, then
asleep between polls), runs the job (joining the pool, as a host step does) and sets its done
flag. A step is one replay with no driver thread and no Python between the layers.

The flags are zeroed before each replay (:meth:`FlagJobs.set_rows`), while no replay reads
them. A go flag that is not set in time means the graph is stuck: every done flag is set, so
the replay runs on to its end, and :class:`FlagJobsError` is raised. The serving call is the
same on the CPU, where the CPU tests set the go flags from another thread.

Threads: made and set by the engine's main thread, which serves the jobs; the GPU writes the
go flags and reads the done flags.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from freetoken import env
from freetoken.config.engine import MOE_CPU_SPIN_US
from freetoken.cpu import abi
from freetoken.cpu.host_node import HostNodeError, HostNodes, host_nodes
from freetoken.cpu.row_copy import DRIVER

MAX_JOBS = 1024  # jobs of one graph (a job per CPU layer and piece); the flags do not move
WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
TIMEOUT_MS = 30_000  # a go flag not set by then: the graph is stuck


@cache
def stream_memops() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | str:
    """The driver's ``cuStreamWriteValue32`` and ``cuStreamWaitValue32`` (their v2 entry
    points, which CUDA 12 supports on every device), or why there are none."""
    try:
        lib = ctypes.CDLL(DRIVER)
    except OSError as e:
        return f"the CUDA driver ({DRIVER}) does not load: {e}"
    fns = []
    for base in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        fn = getattr(lib, f"{base}_v2", None)
        if fn is None:
            return f"the CUDA driver has no {base}_v2"
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fns.append(fn)
    return fns[0], fns[1]


def graph_jobs() -> type[HostNodes] | str:
    """What runs the cpu strategy's pool jobs inside decode graphs (FREETOKEN_CPU_HOST_NODE):
    :class:`HostNodes` (``on``), :class:`FlagJobs` (``flag``), or why neither does (then a
    host step between graph pieces runs each job)."""
    how = env.cpu_host_node()
    if how == "flag":
        memops = stream_memops()
        return memops if isinstance(memops, str) else FlagJobs
    reason = host_nodes()
    return HostNodes if reason is None else reason


class FlagJobsError(HostNodeError):
    """A graph's flag did not come, or the driver refused a flag's write or wait."""


class FlagJobs(HostNodes):
    """The flag-served jobs of one decode graph (:class:`HostNodes`' jobs and step), their
    flags, and which jobs each piece of the graph holds."""

    def __init__(self) -> None:
        super().__init__()
        self.step.core = -1  # the engine thread serves the jobs on its own core
        self._spin_us = MOE_CPU_SPIN_US  # the replay's tail after the last job is short
        self.flags = torch.zeros((2, MAX_JOBS), dtype=torch.int32,
                                 pin_memory=torch.cuda.is_available())
        self.timeout_ms = TIMEOUT_MS
        self.pieces: dict[int, tuple[int, int]] = {}  # piece -> (first job, jobs)
        self._array: ctypes.Array[abi.HostNodeJob] | None = None  # the jobs, laid out once
        self._ranges: dict[int, abi.FlagJobs] = {}  # per piece, on _array

    def enqueue(self, job: abi.HostNodeJob, stream: int, piece: int = 0) -> None:
        """``job`` (the last one made) after the work queued on ``stream`` so far: its go
        flag written, then a wait for its done flag, in the stream (captured: in piece
        ``piece`` of the graph)."""
        memops = stream_memops()
        if isinstance(memops, str):
            raise FlagJobsError(memops)
        write, wait = memops
        i = self.hold(job, piece)
        go, done = (self.flags[r, i].data_ptr() for r in range(2))
        for what, err in (("write", write(stream, go, 1, 0)),
                          ("wait", wait(stream, done, 1, WAIT_EQ))):
            if err:
                raise FlagJobsError(f"the CUDA driver refused a flag's {what}: error {err}")

    def hold(self, job: abi.HostNodeJob, piece: int) -> int:
        """``job`` (the last one made) counted in piece ``piece``'s jobs; returns its index
        (its flags'). :meth:`enqueue` calls it as it captures the flags; the CPU tests call
        it alone and write the go flags themselves."""
        i = len(self.jobs) - 1
        if i < 0 or self.jobs[i][0] is not job:
            raise ValueError("a flag job is held right after it is made")
        if i >= MAX_JOBS:
            raise FlagJobsError(f"a decode graph holds at most {MAX_JOBS} CPU jobs")
        first, n = self.pieces.get(piece, (i, 0))
        if first + n != i:
            raise ValueError(f"piece {piece}'s jobs are not consecutive")
        self.pieces[piece] = (first, n + 1)
        return i

    def set_rows(self, n: int) -> None:
        """The live rows of the next replay, and its flags zeroed."""
        super().set_rows(n)
        self.flags.zero_()

    def serve(self, piece: int) -> None:
        """Serve piece ``piece``'s jobs as its replay reaches them (after the replay is
        launched); returns when the last one is done."""
        if piece not in self.pieces:
            return
        code = self.lib.ft_flag_jobs_serve(ctypes.byref(self._range(piece)))
        if code:
            first, n = self.pieces[piece]
            got = self._ranges[piece].served
            raise FlagJobsError(f"a decode graph did not signal its CPU job {first + got} (of "
                                f"jobs {first}..{first + n - 1}) in {self.timeout_ms} ms")

    def release(self) -> None:
        """Every done flag set: a replay left waiting (its serving interrupted) runs on."""
        for piece in self.pieces:
            self.lib.ft_flag_jobs_release(ctypes.byref(self._range(piece)))

    def _range(self, piece: int) -> abi.FlagJobs:
        """Piece ``piece``'s jobs for the library (laid out again if jobs came since)."""
        if self._array is None or len(self._array) != len(self.jobs):
            self._array = (abi.HostNodeJob * len(self.jobs))(*(j for j, _ in self.jobs))
            self._ranges.clear()
        found = self._ranges.get(piece)
        if found is None:
            first, n = self.pieces[piece]
            found = self._ranges[piece] = abi.FlagJobs(
                self._array, self.flags[0].data_ptr(), self.flags[1].data_ptr(), first, n,
                MOE_CPU_SPIN_US, self.timeout_ms, 0, 0)
        return found
