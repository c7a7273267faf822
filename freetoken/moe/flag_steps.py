"""A host plan's steps inside a decode CUDA graph's piece, on its flags
(``FREETOKEN_HOST_STEPS=flags``; ``cpu/graph_flags.py``): the graph sets a flag in pinned
memory and waits for one the host sets (:class:`FlagHostStep`), or one the CPU pool sets as its
job ends (:class:`FlagLateStep`); the engine thread serves them after launching the piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from freetoken.cpu.graph_flags import FlagJobs
from freetoken.cpu.row_copy import RowCopier, Spans, current_stream
from freetoken.moe.host_steps import HostCopies, HostStep


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
        self.k = flags.add_step(self, piece)
        self._copy_in(self._make_views(x.shape[0]), sync=False)  # every row, captured
        stream = current_stream(self.device)
        flags.signal(stream, 2, self.k)
        flags.await_flag(stream, 3, self.k)

    def serve(self, n: int) -> None:
        views = self._views_of(n)
        self.flags.wait_go(self.k)
        with torch.cuda.stream(self.side):
            if not self._plan_once(views, n):  # its result landed: the graph may go on
                self._signal()

    def _make_views(self, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                           Spans | None, tuple[torch.Tensor, ...], HostCopies]:
        copies, spans, inputs, host = super()._make_views(n)
        return copies, spans, inputs, replace(host, ready=self._ready)

    def _ready(self) -> None:
        """The plan's device work is queued (on the side stream): ``out`` cleared if a result
        was left there, then the done flag the graph waits for set after it."""
        if not self._early:
            self._early = True
            self.land(None, 0)
            self._signal()

    def _signal(self) -> None:
        """The side stream sets the done flag after the work queued on it so far."""
        self.flags.signal(self.side.cuda_stream, 3, self.k)


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
