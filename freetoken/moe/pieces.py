"""Where host-planned experts break a decode CUDA graph into pieces.

Layers whose experts the host must plan (offload, hybrid: which slot, fetch or CPU) cannot run
inside one captured graph. While decode graphs are captured (``engine/graph.py``), their
experts call :class:`PiecewiseCapture` instead of running: it ends the current piece and
records the host's part, which the graph runner calls between replays of the pieces
(:class:`HostStep`: the plan, with its inputs in pinned memory after one sync;
:class:`LateStep`: work the plan left running, collected without a sync; :class:`Break`: a
whole experts call). What each puts in its static ``out`` buffer the next piece reads.
With ``FREETOKEN_HOST_STEPS=early`` a plan has the next piece launched as soon as its own
device work is queued (``HostCopies.ready``), before look-ahead's plan.
With ``FREETOKEN_HOST_STEPS=flags`` the plans and late steps stay inside the piece instead
(:class:`FlagHostStep`, :class:`FlagLateStep`): the graph sets a flag in pinned memory and
waits for one the host sets, and the engine thread serves them after launching the piece
(``cpu/graph_flags.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.gpu_wait import gpu_wait
from freetoken.cpu.graph_flags import FlagJobs, graph_jobs
from freetoken.cpu.host_node import HostNodeError, HostNodes
from freetoken.cpu.row_copy import RowCopier, Spans, current_stream

T = TypeVar("T", "Break", "HostStep", "LateStep")


class Recorder:
    """What the layers whose experts the host plans share with the decode graph runner: it
    sets ``capture`` while it records the model (their calls then become breaks between
    pieces) and copies a host step's inputs with ``rows`` (the library's copier; None: torch's
    copies). The offload runtime is one; layers with no device cache (cpu) share a bare one."""

    def __init__(self, rows: RowCopier | None) -> None:
        self.capture: PiecewiseCapture | None = None  # set while decode graphs are captured
        self.rows = rows


class Break:
    """Host-planned experts between two captured pieces: their inputs and static output."""

    def __init__(self, experts: Callable[..., torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                 w: torch.Tensor) -> None:
        self.experts, self.x, self.ids, self.w = experts, x, ids, w
        self.out = torch.zeros_like(x)

    def run(self, n: int) -> None:
        """The experts for the first ``n`` rows (padded rows keep a stale, finite output)."""
        self.out[:n].copy_(self.experts(self.x[:n], self.ids[:n], self.w[:n]))


@dataclass(frozen=True)
class HostCopies:
    """What a plan between two pieces gets on the host: its inputs' pinned copies (made with
    one sync; x and w float32 when a graph step makes them), ``cpu_out``, a pinned float32
    buffer for the CPU's share, and ``predicted``:
    the next layer's router picks for look-ahead (made in the piece before; None if none),
    ``ready`` and ``cpu_done``."""

    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    cpu_out: torch.Tensor
    predicted: torch.Tensor | None = None
    # called by a plan once the device work its compute reads is queued (copies, slot table),
    # before work it need not wait for (look-ahead's copies): inside the graph (FlagHostStep)
    # the graph goes on, between pieces (FREETOKEN_HOST_STEPS=early) the next piece is
    # launched; such a plan returns None
    ready: Callable[[], None] | None = None
    # inside the graph: the address of the flag the graph waits on before it reads cpu_out, for
    # the pool to set as the CPU's job ends (0: none; the host sets it after the job)
    cpu_done: int = 0

    @property
    def inputs(self) -> bool:
        """Whether x and w were copied (a plan that reads only the ids gets them empty)."""
        return self.x.shape[0] == self.ids.shape[0]


class _Landing:
    """A static buffer ``out`` (shaped like ``like``) that the next piece adds, and what a host
    step puts there: a result (copied in without a wait: it is pinned or on the device) or
    zeros (cleared again only after a result)."""

    def __init__(self, like: torch.Tensor, out: torch.Tensor | None = None) -> None:
        self.out = torch.zeros_like(like) if out is None else out
        self.dirty = False

    def land(self, extra: torch.Tensor | None, n: int) -> None:
        if extra is not None:
            self.out[:n].copy_(extra, non_blocking=True)
            self.dirty = True
        elif self.dirty:
            self.out.zero_()
            self.dirty = False


class HostStep(_Landing):
    """A plan between two captured pieces: ``plan(x, ids, w, host)`` gets the device inputs
    and their :class:`HostCopies` (with ``predicted``'s, a tensor the piece before made, when
    given); it returns None or a device tensor, which lands in ``out``.
    Work it leaves running (hybrid's CPU share, written into ``host.cpu_out``) is collected by
    a :class:`LateStep` after the next piece.

    The pinned buffers are rewritten only after :meth:`run`'s sync, which comes after every
    copy that read them at the previous replay (this step's and its LateStep's, both queued
    earlier on the same stream)."""

    def __init__(self, plan: Callable[..., torch.Tensor | None], x: torch.Tensor,
                 ids: torch.Tensor, w: torch.Tensor, inputs: bool,
                 copier: RowCopier | None = None,
                 predicted: torch.Tensor | None = None,
                 like: torch.Tensor | None = None) -> None:
        super().__init__(x if like is None else like)
        self.plan, self.x, self.ids, self.w = plan, x, ids, w
        self.predicted = predicted
        self.copier = copier  # the inputs' copies and the sync in one library call
        self.device = x.device.index or 0
        self.inputs = inputs  # the plan reads x and w on the host, not only the ids
        # per row count, made once: the inputs' (dst, src) copies and their library layout
        # (one call with the sync), and the views the plan gets
        self._views: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], Spans | None,
                                     tuple[torch.Tensor, ...], HostCopies]] = {}

        def pinned(t: torch.Tensor, dtype: torch.dtype | None = None,
                   needed: bool = True) -> torch.Tensor:
            shape = t.shape if needed else (0, *t.shape[1:])
            return torch.zeros(shape, dtype=dtype or t.dtype, pin_memory=True)

        self.host = HostCopies(pinned(x, needed=inputs), pinned(ids), pinned(w, needed=inputs),
                               pinned(x, torch.float32, needed=inputs),
                               None if predicted is None else pinned(predicted))
        self._go: Callable[[], None] | None = None  # run's launch of the next piece

    def run(self, n: int, launch: Callable[[], None] | None = None) -> bool:
        """The plan on the first ``n`` rows. With ``launch`` (the graph runner's launch of the
        next piece), a plan that says its device work is queued (``host.ready``) has the next
        piece launched there, before the rest of its work (look-ahead's plan): returns whether
        it was."""
        views = self._views_of(n)
        self._copy_in(views, sync=True)
        _, _, (x, ids, w), host = views
        self._go = launch
        try:
            extra = self.plan(x, ids, w, host)
        finally:
            early, self._go = launch is not None and self._go is None, None
        if early:
            if extra is not None:
                raise RuntimeError("a plan that said its device work was ready returned more")
            return True
        self.land(extra, n)
        return False

    def _ready(self) -> None:
        """The plan's device work is queued (on the current stream): ``out`` cleared if a
        result was left there, then the next piece launched, if :meth:`run` was given how."""
        go, self._go = self._go, None
        if go is not None:
            self.land(None, 0)
            go()

    def _views_of(self, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                         Spans | None, tuple[torch.Tensor, ...], HostCopies]:
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = self._make_views(n)
        return views

    def _copy_in(self, views: tuple[list[tuple[torch.Tensor, torch.Tensor]], Spans | None,
                                    tuple[torch.Tensor, ...], HostCopies], sync: bool) -> None:
        """The inputs copied to the host on the current stream (``sync``: then waited for)."""
        copies, spans, _, _ = views
        if self.copier is not None and spans is not None:
            self.copier.run(spans, current_stream(self.device), sync=sync)
            return
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        if sync:
            gpu_wait(self.device).wait()

    def _make_views(self, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                           Spans | None, tuple[torch.Tensor, ...], HostCopies]:
        h = self.host
        pairs = [(self.ids, h.ids)]
        if self.predicted is not None:
            assert h.predicted is not None
            pairs.append((self.predicted, h.predicted))
        if self.inputs:
            pairs += [(self.w, h.w), (self.x, h.x)]
        copies = [(dst[:n], src[:n]) for src, dst in pairs]
        spans = None if self.copier is None else Spans(copies)
        host = HostCopies(h.x[:n], h.ids[:n], h.w[:n], h.cpu_out[:n],
                          None if h.predicted is None else h.predicted[:n], self._ready)
        return copies, spans, (self.x[:n], self.ids[:n], self.w[:n]), host


class LateStep(_Landing):
    """Host work a plan left running, finished between the next two pieces without a sync
    (the device goes on with what was queued): ``finish()`` returns None or a pinned or
    device tensor with the step's rows, which lands in ``out``."""

    def __init__(self, finish: Callable[[], torch.Tensor | None], like: torch.Tensor) -> None:
        super().__init__(like)
        self.finish = finish

    def run(self, n: int) -> None:
        self.land(self.finish(), n)


class FlagHostStep(HostStep):
    """A :class:`HostStep` inside the piece, served on the graph's flags (``cpu/
    graph_flags.py``): the piece copies the inputs to pinned memory, sets the step's go flag
    and waits for its done flag; the engine thread, once it sees go, plans on a side stream
    (its copies, the slot table and what lands in ``out`` go there), and that stream sets done
    after them. No sync, no break, no second launch."""

    def __init__(self, plan: Callable[..., torch.Tensor | None], x: torch.Tensor,
                 ids: torch.Tensor, w: torch.Tensor, inputs: bool, copier: RowCopier | None,
                 predicted: torch.Tensor | None, like: torch.Tensor, flags: FlagJobs,
                 side: torch.cuda.Stream, piece: int) -> None:
        super().__init__(plan, x, ids, w, inputs, copier, predicted, like)
        self.flags, self.side = flags, side
        self._signalled = False
        self.cpu_done = 0  # the flag of the late step that reads host.cpu_out (FlagLateStep)
        self.k = flags.add_step(self, piece)
        self._copy_in(self._make_views(x.shape[0]), sync=False)  # every row, captured
        stream = current_stream(self.device)
        flags.signal(stream, 2, self.k)
        flags.await_flag(stream, 3, self.k)

    def serve(self, n: int) -> None:
        _, _, (x, ids, w), host = self._views_of(n)
        self.flags.wait_go(self.k)
        self._signalled = False
        with torch.cuda.stream(self.side):
            extra = self.plan(x, ids, w, host)
            if not self._signalled:
                self.land(extra, n)
                self._ready()
            elif extra is not None:
                raise RuntimeError("a plan that said its device work was ready returned more")

    def _make_views(self, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                           Spans | None, tuple[torch.Tensor, ...], HostCopies]:
        copies, spans, inputs, host = super()._make_views(n)
        return copies, spans, inputs, replace(host, ready=self._ready, cpu_done=self.cpu_done)

    def _ready(self) -> None:
        """The plan's device work is queued (on the side stream): ``out`` cleared if a result
        was left there, then the side stream sets the done flag the graph waits for."""
        if not self._signalled:
            self.land(None, 0)
            self.flags.signal(self.side.cuda_stream, 3, self.k)
            self._signalled = True


class FlagLateStep:
    """A :class:`LateStep` inside the piece, served on the graph's flags: the piece waits for
    the step's done flag, then copies ``source`` (the pinned float32 ``cpu_out`` of the host
    step before it) in and casts it (``result``). The pool's job sets that flag itself as it
    writes ``source`` (``HostCopies.cpu_done``), so the graph goes on without the engine thread;
    the engine thread collects ``finish()`` after, and where no job ran it zeroes ``source`` and
    sets the flag."""

    def __init__(self, finish: Callable[[], torch.Tensor | None], like: torch.Tensor,
                 flags: FlagJobs, piece: int, source: torch.Tensor,
                 copier: RowCopier | None = None) -> None:
        if source.dtype is not torch.float32 or source.shape != like.shape:
            raise ValueError("a flag late step reads a float32 host buffer shaped like its "
                             "output")
        self.finish, self.flags, self.source = finish, flags, source
        self.dirty = True  # what source holds is unknown until a call zeroes it
        self.k = flags.add_step(self, piece)
        stream = current_stream(like.device.index or 0)
        flags.await_flag(stream, 3, self.k)
        staged = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        if copier is not None:  # the driver's copy, as a graph's jobs copy their results
            copier.run(Spans([(staged, source)]), stream)
        else:
            staged.copy_(source, non_blocking=True)
        self.result = staged.to(like.dtype)

    @property
    def done_flag(self) -> int:
        """The address of the done flag, for the job that writes ``source`` to set."""
        return self.flags.address(3, self.k)

    def serve(self, n: int) -> None:
        extra = self.finish()
        if extra is None:
            if self.dirty:
                self.source.zero_()
                self.dirty = False
        elif extra.data_ptr() != self.source.data_ptr():
            self.source[:n].copy_(extra)
            self.dirty = True
        else:
            self.dirty = True
        self.flags.set_done(self.k)


class PiecewiseCapture:
    """Capture state while a model forward is being recorded in pieces.

    Host-planned experts call :meth:`host` (or :meth:`split`) instead of running: it ends the
    current piece, records a :class:`HostStep` (or :class:`Break`) and begins the next piece,
    all in one memory pool. :meth:`after` does the same for a :class:`LateStep`. Experts the
    CPU pool computes without a plan call :meth:`node`, which stays in the piece. Flagged,
    :meth:`host` and :meth:`after` stay in the piece too, on the capture's flags.
    """

    def __init__(self, pool: tuple[int, int], copier: RowCopier | None = None,
                 fetching: bool = False, flagged: bool = False) -> None:
        self.pool, self.copier = pool, copier
        # host steps inside the pieces, served on flags, their plans on this stream
        self.side = torch.cuda.Stream() if flagged else None
        # the graph is for steps in which every layer fetches every miss: hybrid layers plan
        # as offload's, from the ids alone, with no late step (``engine/graph.py``)
        self.fetching = fetching
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[Break | HostStep | LateStep] = []
        self.nodes: HostNodes | None = None  # made by the first node()
        self._flag_host: FlagHostStep | None = None  # the last, for the late step after it
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
             predicted: torch.Tensor | None = None) -> torch.Tensor:
        """``plan`` between two pieces (``inputs``: it reads x and w on the host, not only the
        ids: the piece casts them to float32, what the CPU pool reads, so the host converts
        nothing; ``predicted``: a tensor the piece made, copied with the ids); returns the
        static buffer (shaped and typed like ``x``) of its extra output, for the captured
        compute that follows to add."""
        xf, wf = (x.float(), w.float()) if inputs else (x, w)  # ops of the current piece
        if self.side is not None:
            step = self._flag_host = FlagHostStep(plan, xf, ids, wf, inputs, self.copier,
                                                  predicted, x, self._flags(), self.side,
                                                  len(self.pieces))
            return step.out
        return self._between(lambda: HostStep(plan, xf, ids, wf, inputs, self.copier,
                                              predicted, like=x)).out

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
        returns the static buffer (shaped like ``like``) of its result. Flagged: inside the
        piece, after the host step before it (:class:`FlagLateStep`)."""
        if self.side is not None:
            step, self._flag_host = self._flag_host, None
            if step is None or not step.inputs:
                raise ValueError("a flag late step follows the host step whose job it reads")
            late = FlagLateStep(finish, like, self._flags(), len(self.pieces),
                                step.host.cpu_out, self.copier)
            step.cpu_done = late.done_flag
            return late.result
        return self._between(lambda: LateStep(finish, like)).out

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
