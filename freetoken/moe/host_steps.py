"""A host plan's steps between two pieces of a decode CUDA graph (``moe/pieces.py`` records
them): :class:`HostStep` (the plan, with its inputs in pinned memory after one sync, as
:class:`HostCopies`), :class:`LateStep` (work the plan left running, collected without a sync)
and :class:`Break` (a whole experts call). What each puts in its static ``out`` buffer the next
piece reads. With ``FREETOKEN_HOST_STEPS=early`` (the default) a plan has the next piece
launched as soon as its own device work is queued (``HostCopies.ready``: its copies, table and
look-ahead where the library made it), before its bookkeeping. A plan may come with a
``prepare`` (what needs no inputs: the library's call found, the split's and look-ahead's rules
set, the copies' events taken), which runs while the piece before computes, or earlier still:
a late step runs the next plan's while the CPU's job it waits for runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from freetoken.cpu.gpu_wait import gpu_wait
from freetoken.cpu.row_copy import RowCopier, Spans, current_stream


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
    # called by a plan once the device work its compute reads is queued (copies, slot table;
    # look-ahead's too where the library made it), before work the next piece need not wait
    # for (Python's look-ahead, the stats): inside the graph (FlagHostStep)
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


class Prepared:
    """What a host step's ``prepare`` left for the plan that follows: the host copies it was
    made on and the library's layer call it set up (None: none). A plain object: the engine
    thread writes it every call, which an nn.Module attribute makes slow."""

    __slots__ = ("host", "call")

    def __init__(self) -> None:
        self.host: HostCopies | None = None
        self.call: Any = None  # a moe/layer_call.py LayerCall


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
                 like: torch.Tensor | None = None,
                 prepare: Callable[[HostCopies], None] | None = None) -> None:
        super().__init__(x if like is None else like)
        self.plan, self.x, self.ids, self.w = plan, x, ids, w
        # what the plan does before its inputs arrive: run while the piece before computes,
        # or earlier, by the late step before it (:meth:`prepare_ahead`)
        self.prepare = prepare
        self._ahead_for: int | None = None  # the rows prepare_ahead ran for, until run
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
        # the flag a late step inside the next piece waits on (FlagLateStep), for the pool's
        # job to set as it writes cpu_out (0: none)
        self.cpu_done = 0
        self._go: Callable[[], None] | None = None  # run's launch of the next piece
        self._early = False  # the plan running now said its device work was queued

    def run(self, n: int, launch: Callable[[], None] | None = None) -> bool:
        """The plan on the first ``n`` rows. With ``launch`` (the graph runner's launch of the
        next piece), a plan that says its device work is queued (``host.ready``) has the next
        piece launched there, before the rest of its work (look-ahead's plan): returns whether
        it was."""
        views = self._views_of(n)
        ahead, self._ahead_for = self._ahead_for == n, None
        if self.prepare is None or ahead:
            self._copy_in(views, sync=True)
        else:  # the copies queued, the plan's first part while the piece before runs
            self._copy_in(views, sync=False)
            self.prepare(views[3])
            self._wait()
        self._go = launch
        try:
            return self._plan_once(views, n)
        finally:
            self._go = None

    def prepare_ahead(self, n: int) -> None:
        """The plan's ``prepare`` for the first ``n`` rows now, before the piece before this
        step is even launched (a late step calls it while the CPU's job runs on): :meth:`run`
        then only copies the inputs in and waits for them. A prepare needs no inputs, so it may
        run this early; the host then meets the routed ids as they arrive, not after it."""
        if self.prepare is not None:
            self._ahead_for = None
            self.prepare(self._views_of(n)[3])
            self._ahead_for = n

    def _plan_once(self, views: tuple[list[tuple[torch.Tensor, torch.Tensor]], Spans | None,
                                      tuple[torch.Tensor, ...], HostCopies], n: int) -> bool:
        """The plan on ``views``: True where it said its device work was queued (``host.
        ready``, which acted on it; such a plan returns nothing), else its result landed."""
        _, _, (x, ids, w), host = views
        self._early = False
        extra = self.plan(x, ids, w, host)
        if not self._early:
            self.land(extra, n)
            return False
        if extra is not None:
            raise RuntimeError("a plan that said its device work was ready returned more")
        return True

    def _ready(self) -> None:
        """The plan's device work is queued (on the current stream): ``out`` cleared if a
        result was left there, then the next piece launched, if :meth:`run` was given how."""
        go, self._go = self._go, None
        if go is not None:
            self._early = True
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
            self._wait()

    def _wait(self) -> None:
        """The host waits for the current stream's work so far (the input copies)."""
        if self.x.is_cuda:
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
                          None if h.predicted is None else h.predicted[:n], self._ready,
                          self.cpu_done)
        return copies, spans, (self.x[:n], self.ids[:n], self.w[:n]), host


class LateStep(_Landing):
    """Host work a plan left running, finished between the next two pieces without a sync
    (the device goes on with what was queued): ``finish()`` returns None or a pinned or
    device tensor with the step's rows, which lands in ``out``, float32 (shaped like
    ``like``): the pool's pinned float32 result is one plain copy to the device, which the
    next piece casts to ``like``'s dtype. (Into a landing of ``like``'s dtype torch converts
    on the host, into pageable memory, whose copy to the device may wait for the stream: from
    the job's end to the next piece's launch took 68 us a layer on an H100 with it,
    ``benchmarks/step_timeline.py`` at 4340331.)"""

    def __init__(self, finish: Callable[[], torch.Tensor | None], like: torch.Tensor) -> None:
        super().__init__(like, torch.zeros(like.shape, dtype=torch.float32, device=like.device))
        self.finish = finish
        # the host step after the next piece, whose prepare runs here while the CPU's job does
        # (the engine thread's time before the job ends is otherwise a wait)
        self.then: HostStep | None = None

    def run(self, n: int) -> None:
        try:
            if self.then is not None:
                self.then.prepare_ahead(n)
        finally:  # the job is collected even where the prepare failed
            self.land(self.finish(), n)
