"""Where host-planned experts break a decode CUDA graph into pieces.

Layers whose experts the host must plan (offload, hybrid: which slot, fetch or CPU) cannot run
inside one captured graph. While decode graphs are captured (``engine/graph.py``), their
experts call :class:`PiecewiseCapture` instead of running: it ends the current piece and
records the host's part (``moe/host_steps.py``), which the graph runner calls between replays
of the pieces. With ``FREETOKEN_HOST_STEPS=flags`` the plans and late steps stay inside the
piece instead (``moe/flag_steps.py``); with ``FREETOKEN_LATE_STEPS=flags`` the late steps
alone do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.graph_flags import FlagJobs, graph_jobs
from freetoken.cpu.host_node import HostNodeError, HostNodes
from freetoken.cpu.row_copy import RowCopier, Spans, current_stream
from freetoken.moe.flag_steps import FlagHostStep, FlagLateStep
from freetoken.moe.host_steps import Break, HostCopies, HostStep, LateStep

T = TypeVar("T", "Break", "HostStep", "LateStep")


class Recorder:
    """What the layers whose experts the host plans share with the decode graph runner: it
    sets ``capture`` while it records the model (their calls then become breaks between
    pieces) and copies a host step's inputs with ``rows`` (the library's copier; None: torch's
    copies). The offload runtime is one; layers with no device cache (cpu) share a bare one."""

    def __init__(self, rows: RowCopier | None) -> None:
        self.capture: PiecewiseCapture | None = None  # set while decode graphs are captured
        self.rows = rows


class PiecewiseCapture:
    """Capture state while a model forward is being recorded in pieces.

    Host-planned experts call :meth:`host` (or :meth:`split`) instead of running: it ends the
    current piece, records a :class:`HostStep` (or :class:`Break`) and begins the next piece,
    all in one memory pool. :meth:`after` does the same for a :class:`LateStep`. Experts the
    CPU pool computes without a plan call :meth:`node`, which stays in the piece. Flagged,
    :meth:`host` and :meth:`after` stay in the piece too, on the capture's flags.
    """

    def __init__(self, pool: tuple[int, int], copier: RowCopier | None = None,
                 fetching: bool = False, flagged: bool = False,
                 late_flags: bool = False) -> None:
        self.pool, self.copier = pool, copier
        # host steps between pieces, their late steps inside the next piece on flags
        self.late_flags = late_flags and not flagged
        # host steps inside the pieces, served on flags, their plans on this stream
        self.side = torch.cuda.Stream() if flagged else None
        # the graph is for steps in which every layer fetches every miss: hybrid layers plan
        # as offload's, from the ids alone, with no late step (``engine/graph.py``)
        self.fetching = fetching
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[Break | HostStep | LateStep] = []
        self.nodes: HostNodes | None = None  # made by the first node()
        # the last host step, for a late step on flags after it
        self._last_host: FlagHostStep | HostStep | None = None
        # pinned buffers of the nodes, by (rows, hidden, top-k): the layers take turns on them
        # in stream order
        self._node_buffers: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        self.current = torch.cuda.CUDAGraph()

    def begin(self) -> None:
        self.current.capture_begin(pool=self.pool)

    def split(self, experts: Callable[..., torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
              w: torch.Tensor) -> torch.Tensor:
        """The whole experts call between two pieces; returns its static output buffer."""
        return self._between(lambda: Break(experts, x, ids, w)).out

    def host(self, plan: Callable[..., torch.Tensor | None], x: torch.Tensor, ids: torch.Tensor,
             w: torch.Tensor, inputs: bool = True,
             predicted: torch.Tensor | None = None,
             prepare: Callable[[HostCopies], None] | None = None) -> torch.Tensor:
        """``plan`` between two pieces (``inputs``: it reads x and w on the host, not only the
        ids: the piece casts them to float32, what the CPU pool reads, so the host converts
        nothing; ``predicted``: a tensor the piece made, copied with the ids); returns the
        static buffer (shaped and typed like ``x``) of its extra output, for the captured
        compute that follows to add. ``prepare``: what the plan can do before its inputs
        arrive, run between pieces while the piece before computes (on flags the plan does
        it all)."""
        xf, wf = (x.float(), w.float()) if inputs else (x, w)  # ops of the current piece
        if self.side is not None:
            step = self._last_host = FlagHostStep(plan, xf, ids, wf, inputs, self.copier,
                                                  predicted, x, self._flags(), self.side,
                                                  len(self.pieces))
            return step.out
        late = self.breaks[-1] if self.breaks else None
        step = self._between(lambda: HostStep(plan, xf, ids, wf, inputs, self.copier,
                                              predicted, like=x, prepare=prepare))
        if isinstance(late, LateStep):  # the late step before prepares this step's plan
            late.then = step
        if self.late_flags:
            self._last_host = step
        return step.out

    def node(self, executor: CpuMoeExecutor, layer: int, x: torch.Tensor, ids: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
        """The pool's job on layer ``layer``'s experts inside the current piece: x, ids and w
        copied to pinned memory, the job as a host node (``cpu/host_node.py``) or served on
        flags (``cpu/graph_flags.py``), its result copied back; returns it on the device,
        typed like ``x``. Needs the library's copier."""
        assert self.copier is not None
        if self.side is not None:  # with the host steps on the same flags
            self._flags()
        elif self.nodes is None:
            kind = graph_jobs()
            if isinstance(kind, str):
                raise HostNodeError(kind)
            self.nodes = kind()
        assert self.nodes is not None
        (T, H), A = x.shape, ids.shape[1]
        key = (T, H, A)
        if key not in self._node_buffers:
            self._node_buffers[key] = tuple(
                torch.zeros(shape, dtype=dtype, pin_memory=True)
                for shape, dtype in (((T, H), torch.float32), ((T, A), torch.int64),
                                     ((T, A), torch.float32), ((T, H), torch.float32)))
        hx, hids, hw, hout = self._node_buffers[key]
        out = torch.empty((T, H), dtype=torch.float32, device=x.device)
        stream = current_stream(x.device.index or 0)
        inputs = [(hx, x.float()), (hids, ids.long()), (hw, w.float())]
        self.copier.run(Spans([(h, d.contiguous()) for h, d in inputs]), stream)
        self.nodes.enqueue(self.nodes.job(executor, layer, hx, hids, hw, hout), stream,
                           len(self.pieces))
        self.copier.run(Spans([(out, hout)]), stream)
        return out.to(x.dtype)

    def after(self, finish: Callable[[], torch.Tensor | None],
              like: torch.Tensor) -> torch.Tensor:
        """``finish`` between two pieces, after the device work queued so far (no sync);
        returns its result from the static buffer (float32), cast to ``like``'s dtype in the
        piece that begins. Flagged (or with
        late steps on flags): inside the piece, after the host step before it
        (:class:`FlagLateStep`; a late step on flags is not made where the capture's jobs run
        as host nodes: those are not served on flags)."""
        step, self._last_host = self._last_host, None
        if self.side is not None or (self.late_flags and (
                self.nodes is None or isinstance(self.nodes, FlagJobs))):
            if step is None or not step.inputs:
                raise ValueError("a flag late step follows the host step whose job it reads")
            late = FlagLateStep(finish, like, self._flags(), len(self.pieces),
                                step.host.cpu_out, self.copier)
            step.cpu_done = late.done_flag
            return late.result
        return self._between(lambda: LateStep(finish, like)).out.to(like.dtype)

    def _flags(self) -> FlagJobs:
        """The flags of this capture's host steps and jobs (made by the first)."""
        if self.nodes is None:
            self.nodes = FlagJobs()
        assert isinstance(self.nodes, FlagJobs)
        return self.nodes

    def _between(self, make: Callable[[], T]) -> T:
        """End the current piece, make the break (outside any capture: its buffers must not
        be written by a replay), begin the next piece."""
        self.current.capture_end()
        self.pieces.append(self.current)
        item = make()
        self.breaks.append(item)
        self.current = torch.cuda.CUDAGraph()
        self.current.capture_begin(pool=self.pool)
        return item

    def end(self) -> None:
        self.current.capture_end()
        self.pieces.append(self.current)
