"""The CPU pool's controls and what its workers are doing: switches for later jobs (item
timing, how down_proj splits, whether the waiting thread joins, when dense jobs batch, gate/up
rows per item), the stream-read ceiling (``ft bench bw``, the CPU benchmarks) and each
worker's state (stack dumps, the watchdog). A part of
:class:`~freetoken.cpu.executor.CpuMoeExecutor`, which holds the pool and the library handle
these methods use."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from freetoken.cpu.abi import WORKER_FIELDS, WORKER_STATES

DOWN_SPLITS = {"auto": -1, "rows": 0, "experts": 1}  # csrc/expert_op.h DownSplit


class PoolControls:
    """The pool's switches, reads and worker states (mixed into the executor)."""

    _lib: Any
    _handle: Any
    _timing: bool
    threads: int
    cores: list[int]

    @property
    def timing(self) -> bool:
        """Whether later jobs are timed item by item (:meth:`set_timing`)."""
        return self._timing

    def set_timing(self, on: bool) -> None:
        """Time every item of later jobs: their futures then carry a :class:`JobTiming`."""
        self._timing = on
        self._lib.ft_set_timing(self._handle, int(on))

    def set_down_split(self, split: str) -> None:
        """How later jobs split down_proj over the workers: "auto" ("experts" for decode-sized
        jobs, else "rows"), "rows" (a chunk of H rows of every routed expert per item) or
        "experts" (a chunk of one expert's rows per item, then a sum over pairs). Both give
        the same bits."""
        if split not in DOWN_SPLITS:
            raise ValueError(f"unknown down split {split!r} (choose from {', '.join(DOWN_SPLITS)})")
        self._lib.ft_set_down_split(self._handle, DOWN_SPLITS[split])

    def set_join(self, on: bool) -> None:
        """Whether the thread in ``wait()`` runs items of its job (the default: one more core on
        the job) or only blocks (its caches stay its own, for the Python work after)."""
        self._lib.ft_set_join(self._handle, int(on))

    def set_batch_from(self, vectors: int) -> None:
        """Dense-matrix jobs of ``vectors`` vectors or more run the batched kernels, whose last
        bits differ from the row kernels'; 0: none does (the default: ``batch_vectors()``).
        The runner sets it per forward (1 for prompts, 0 for decode steps), so that a request's
        output does not depend on how many others share its step."""
        self._lib.ft_set_batch_from(self._handle, max(0, vectors))

    def set_gate_up_rows(self, rows: int) -> None:
        """Rows of the intermediate size per gate/up work item of later jobs (a multiple of 32
        up to 128; 0 restores the default). A tuning knob for benchmarks."""
        if self._lib.ft_set_gate_up_rows(self._handle, rows) != 0:
            raise ValueError(f"gate/up rows per item must be 0 or a multiple of 32 up to 128, "
                             f"got {rows}")

    def stream_read_seconds(self, buf: torch.Tensor, reps: int = 1) -> float:
        """Seconds for the workers to read ``buf`` ``reps`` times (the bandwidth ceiling)."""
        return float(
            self._lib.ft_stream_read(
                self._handle, buf.data_ptr(), buf.numel() * buf.element_size(), reps
            )
        )

    def worker_states(self) -> list[dict[str, Any]]:
        """What each worker is doing now (read without stopping them): its core, state, the
        phase of its job, how long it has been in that state, jobs and items it has run."""
        n = len(WORKER_FIELDS)
        buf = (ctypes.c_int64 * (n * self.threads))()
        self._lib.ft_worker_states(self._handle, buf)
        out = []
        for i in range(self.threads):
            rec = dict(zip(WORKER_FIELDS, buf[i * n:(i + 1) * n], strict=True))
            out.append({"worker": i, "core": self.cores[i], "state": WORKER_STATES[rec["state"]],
                        "phase": rec["phase"], "for_ms": rec["for_ns"] / 1e6,
                        "jobs": rec["jobs"], "items": rec["items"]})
        return out

    def free_jobs(self) -> int:
        """Job slots of the pool free now (``MAX_IN_FLIGHT`` when every job submitted has been
        waited for: one never waited for keeps its slot, and ``MAX_IN_FLIGHT`` of them stall
        the next submit)."""
        return int(self._lib.ft_free_jobs(self._handle))

    def describe_workers(self) -> str:
        """:meth:`worker_states` as lines for a stack dump."""
        return "\n".join(
            f"--- pool worker ft-moe-{w['worker']} (core {w['core']}): {w['state']} for "
            f"{w['for_ms']:.1f} ms" + (f", phase {w['phase']}" if w["state"] == "running a job"
                                       else "") + f"; {w['jobs']} jobs, {w['items']} items"
            for w in self.worker_states())
