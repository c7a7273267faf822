"""A decode graph's CPU pool jobs served on flags in pinned memory (``csrc/graph_flags.cpp``).

Host nodes (:mod:`.host_node`) hand each layer's job to the CUDA driver's host thread. Here
the graph signals the engine thread instead: once a layer's inputs are copied to pinned
memory the stream writes that job's go flag (``cuStreamWriteValue32``, ordered after the
copies) and waits in the stream for its done flag (``cuStreamWaitValue32``) before it copies
the result back. The engine thread, which launched the replay, serves a piece's jobs in order
in one library call (:meth:`FlagJobs.serve`): it polls a job's go flag (a bounded spin, then
asleep between polls), runs the job (joining the pool, as a host step does) and sets its done
flag. A step is one replay with no driver thread and no Python between the layers. Host
steps (offload's and hybrid's plans, ``moe/flag_steps.py``) are served on the same flags, in
graph order with the jobs: a plan's done flag is written by the stream it queued its copies on.

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
from typing import Protocol

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
    points, which CUDA 12 supports on every device) once a graph has held and run them, or
    why there are none."""
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
    write, wait = fns
    why = _captured_memops(write, wait)
    return why if why is not None else (write, wait)


def _captured_memops(write: ctypes._CFuncPtr, wait: ctypes._CFuncPtr) -> str | None:
    """Why a CUDA graph cannot hold a flag's write and wait (None: it can, and a replay ran
    them): a driver without stream memory operations in graphs fails the capture. Called
    before any decode graph is captured (:func:`stream_memops` is cached): a capture inside
    another one is not allowed."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            err = (write(stream.cuda_stream, flag.data_ptr(), 1, 0)
                   or wait(stream.cuda_stream, flag.data_ptr(), 1, WAIT_EQ))
        if err:
            return f"the CUDA driver refused a flag's write or wait in a graph: error {err}"
        graph.replay()
        torch.cuda.synchronize()
    except RuntimeError as e:
        return f"a CUDA graph could not hold a flag's write and wait: {e}"
    return None if int(flag[0]) == 1 else "a CUDA graph's flag write did not reach the host"


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


class FlagStep(Protocol):
    """A host step served on a graph's flags (``moe/flag_steps.py``): ``serve(rows)``."""

    def serve(self, n: int) -> None: ...


class FlagJobs(HostNodes):
    """The flag-served jobs of one decode graph (:class:`HostNodes`' jobs and step), the host
    steps served on its flags (:class:`FlagStep`), their flags, and what each piece of the
    graph holds, in graph order: ranges of consecutive jobs (one library call each) and
    steps.

    Flags, one int32 each in pinned memory: rows 0 and 1 a job's go and done, rows 2 and 3 a
    step's go and done (a plan's done is written by a stream, after the plan's copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.step.core = -1  # the engine thread serves the jobs on its own core
        self._spin_us = MOE_CPU_SPIN_US  # the replay's tail after the last job is short
        self.flags = torch.zeros((4, MAX_JOBS), dtype=torch.int32,
                                 pin_memory=torch.cuda.is_available())
        # the same memory for the host's reads and writes, without a torch op per flag
        self._host = self.flags.numpy()
        self._base = self.flags.data_ptr()
        self.timeout_ms = TIMEOUT_MS
        self.steps: list[FlagStep] = []
        self.items: dict[int, list[list[int] | FlagStep]] = {}  # per piece: [first, n] or a step
        self._array: ctypes.Array[abi.HostNodeJob] | None = None  # the jobs, laid out once
        self._ranges: dict[tuple[int, int], abi.FlagJobs] = {}  # per (first, n), on _array

    def enqueue(self, job: abi.HostNodeJob, stream: int, piece: int = 0) -> None:
        """``job`` (the last one made) after the work queued on ``stream`` so far: its go
        flag written, then a wait for its done flag, in the stream (captured: in piece
        ``piece`` of the graph)."""
        i = self.hold(job, piece)
        self.signal(stream, 0, i)
        self.await_flag(stream, 1, i)

    def hold(self, job: abi.HostNodeJob, piece: int) -> int:
        """``job`` (the last one made) counted in piece ``piece``'s items; returns its index
        (its flags'). :meth:`enqueue` calls it as it captures the flags; the CPU tests call
        it alone and write the go flags themselves."""
        i = len(self.jobs) - 1
        if i < 0 or self.jobs[i][0] is not job:
            raise ValueError("a flag job is held right after it is made")
        if i >= MAX_JOBS:
            raise FlagJobsError(f"a decode graph holds at most {MAX_JOBS} CPU jobs")
        items = self.items.setdefault(piece, [])
        last = items[-1] if items else None
        if isinstance(last, list) and sum(last) == i:
            last[1] += 1
        else:
            items.append([i, 1])
        return i

    def add_step(self, step: FlagStep, piece: int) -> int:
        """``step`` served in piece ``piece`` after what the piece holds so far; returns its
        index (its flags' in rows 2 and 3)."""
        k = len(self.steps)
        if k >= MAX_JOBS:
            raise FlagJobsError(f"a decode graph holds at most {MAX_JOBS} host steps")
        self.steps.append(step)
        self.items.setdefault(piece, []).append(step)
        return k

    def address(self, row: int, k: int) -> int:
        """Where flag ``k`` of ``row`` is (host and device address alike)."""
        return self._base + 4 * (row * MAX_JOBS + k)

    def signal(self, stream: int, row: int, k: int) -> None:
        """Flag ``k`` of ``row`` set to 1 by ``stream`` after its work so far."""
        write, _ = self._memops()
        err = write(stream, self.address(row, k), 1, 0)
        if err:
            raise FlagJobsError(f"the CUDA driver refused a flag's write: error {err}")

    def await_flag(self, stream: int, row: int, k: int) -> None:
        """``stream`` waits until flag ``k`` of ``row`` is 1."""
        _, wait = self._memops()
        err = wait(stream, self.address(row, k), 1, WAIT_EQ)
        if err:
            raise FlagJobsError(f"the CUDA driver refused a flag's wait: error {err}")

    def wait_go(self, k: int) -> None:
        """Block until step ``k``'s go flag is set (a bounded spin, then asleep)."""
        if self.lib.ft_flag_wait(self.address(2, k), MOE_CPU_SPIN_US, self.timeout_ms):
            raise FlagJobsError(f"a decode graph did not signal its host step {k} in "
                                f"{self.timeout_ms} ms")

    def set_done(self, k: int) -> None:
        """Step ``k``'s done flag set by the host (its results are in place)."""
        self._host[3, k] = 1

    def set_rows(self, n: int) -> None:
        """The live rows of the next replay, and its flags zeroed."""
        super().set_rows(n)
        self.flags.zero_()

    def serve(self, piece: int) -> None:
        """Serve piece ``piece``'s jobs and steps as its replay reaches them (after the
        replay is launched); returns when the last one is done."""
        for item in self.items.get(piece, ()):
            if not isinstance(item, list):
                item.serve(int(self.step.rows))
                continue
            first, n = item
            f = self._range(first, n)
            if self.lib.ft_flag_jobs_serve(ctypes.byref(f)):
                raise FlagJobsError(f"a decode graph did not signal its CPU job "
                                    f"{first + f.served} (of jobs {first}..{first + n - 1}) "
                                    f"in {self.timeout_ms} ms")

    def release(self) -> None:
        """Every done flag set: a replay left waiting (its serving interrupted) runs on."""
        for items in self.items.values():
            for item in items:
                if isinstance(item, list):
                    self.lib.ft_flag_jobs_release(ctypes.byref(self._range(*item)))
        self.flags[3, :len(self.steps)] = 1

    def _memops(self) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
        memops = stream_memops()
        if isinstance(memops, str):
            raise FlagJobsError(memops)
        return memops

    def _range(self, first: int, n: int) -> abi.FlagJobs:
        """Jobs ``first``.. ``first + n - 1`` for the library (laid out again if jobs came
        since)."""
        if self._array is None or len(self._array) != len(self.jobs):
            self._array = (abi.HostNodeJob * len(self.jobs))(*(j for j, _ in self.jobs))
            self._ranges.clear()
        found = self._ranges.get((first, n))
        if found is None:
            found = self._ranges[first, n] = abi.FlagJobs(
                self._array, self.address(0, 0), self.address(1, 0), first, n,
                MOE_CPU_SPIN_US, self.timeout_ms, 0, 0)
        return found
