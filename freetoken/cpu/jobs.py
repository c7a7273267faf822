"""A job submitted to the CPU pool: its future, and the timing record of where its time went."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class JobTiming:
    """Where one pool job's time went, in seconds from its submit (csrc TimingField).

    ``start``: its first item began; ``ends[p]``: phase p's last item ended (0 for an empty
    phase); ``busy[p]``: time inside phase p's items summed over workers; ``await_s``: time
    down items waited for an expert's gate/up (inside ``busy[2]``).
    """

    start: float
    ends: tuple[float, ...]
    busy: tuple[float, ...]
    await_s: float

    @classmethod
    def from_record(cls, rec: list[int]) -> JobTiming:
        return cls(rec[0] / 1e9, tuple(v / 1e9 for v in rec[1:5]),
                   tuple(v / 1e9 for v in rec[5:9]), rec[9] / 1e9)


class Tickets(Protocol):
    """What a future needs of the pool that took its job (the executor)."""

    @property
    def is_open(self) -> bool:
        """False once the pool is stopped: nothing is left to wait for."""
        ...

    def wait_ticket(self, ticket: int) -> tuple[int, float, JobTiming | None]:
        """Block until job ``ticket`` is done: (weight bytes read, pool seconds, timing)."""
        ...


class CpuMoeFuture:
    """A submitted layer; :meth:`wait` returns its (T, H) float32 result."""

    def __init__(
        self,
        executor: Tickets,
        ticket: int,
        out: torch.Tensor,
        keep: tuple[torch.Tensor, ...],
    ) -> None:
        self._executor = executor
        self._ticket = ticket
        self._out = out
        self._keep = keep  # inputs the workers read until the job is done
        self._done = False
        self.weight_bytes = 0
        self.seconds = 0.0  # the pool's time on the job, from submit to its last item
        self.timing: JobTiming | None = None  # with CpuMoeExecutor.set_timing(True)

    def wait(self) -> torch.Tensor:
        if not self._done:
            self.weight_bytes, self.seconds, self.timing = self._executor.wait_ticket(self._ticket)
            self._done = True
            self._keep = ()
        return self._out

    def __del__(self) -> None:
        # a future dropped unwaited: the workers may still read its inputs and write its
        # output, so those must outlive the job (and its slot must be handed back)
        if not getattr(self, "_done", True) and self._executor.is_open:
            self.wait()


class JobLog:
    """A layer's recent pool jobs as their timing records show them (only with the pool's
    timing on, :meth:`CpuMoeExecutor.set_timing`: a profiling aid), each with its expert
    count: where a job's time went (waking the workers, each phase) against its size."""

    def __init__(self, keep: int = 1024) -> None:
        self.jobs: deque[tuple[JobTiming, float, int]] = deque(maxlen=keep)

    def add(self, future: CpuMoeFuture, experts: int) -> None:
        """A waited ``future``'s record (none without timing) and its ``experts``."""
        if future.timing is not None:
            self.jobs.append((future.timing, future.seconds, experts))
