"""An offloaded layer's decode call between graph pieces, planned in one library call
(``csrc/layer_call.cpp``): the routed ids -> hits and misses, how many misses to fetch (the
split's rule, :meth:`SplitPolicy.rule`), victims and the CPU's pairs, the CPU's job submitted,
the misses' copies queued and the slot table published.

The steps are those of the Python plan (:meth:`OffloadExperts._plan`,
:meth:`HybridExperts._plan_misses`), which stays as the slow twin
(``FREETOKEN_LAYER_CALL=python``, and wherever the library does not make the slot decisions
or the copies). The Python plan calls the library once per step and spends its time in the
interpreter between the calls; right after the engine thread has joined a CPU job its caches
hold expert weights, and each of those steps runs cold.

A :class:`LayerCall` is laid out once per layer and set of host copies (a decode graph's, per
batch size), on buffers that do not move; a call sets the rule, the stream and the copy
span's events.

Threads: the engine's main thread only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

from freetoken import env
from freetoken.cpu import abi
from freetoken.cpu.library import native
from freetoken.cpu.row_copy import RowCopyError, current_stream
from freetoken.moe.host_banks import HostBank
from freetoken.moe.host_job import HostJob
from freetoken.moe.host_steps import HostCopies
from freetoken.moe.lookahead import Incoming, Lookahead
from freetoken.moe.native_slot_pool import NativeSlotPool
from freetoken.moe.runtime import OffloadRuntime
from freetoken.moe.slot_pool import Routed, SlotPool, Split
from freetoken.moe.stats import Span

STREAMS = 1  # plan_layer_call's answer for a call that streams its misses instead
DRIVER_ERROR = -1000  # csrc/layer_call.h kDriverError: its answer less the driver's error


class LayerCall:
    """One layer's call on one set of host copies, as the library plans it."""

    def __init__(self, pool: NativeSlotPool, rt: OffloadRuntime, bank: HostBank, layer: int,
                 host: HostCopies, stream_above: int, job: HostJob | None,
                 incoming: Incoming, lookahead: Lookahead | None) -> None:
        assert rt.rows is not None
        self.pool, self.rt, self.host = pool, rt, host
        T, A = host.ids.shape
        if host.ids.dtype is not torch.int64 or not host.ids.is_contiguous():
            raise ValueError("a layer call reads int64 routed ids, contiguous")
        self.out = np.empty((5, T * A), dtype=np.int64)  # needed, uses, slot, fetched, slots
        self.rows = np.empty((2, T * A), dtype=np.int32)  # the copies' rows
        self._plan = native().ft_plan_layer_call
        c = self.c = abi.LayerCall()
        c.slots = pool.handle
        c.api = ctypes.pointer(rt.rows.api)
        rows_of(c.copy, pool.data, bank.rows, rt)
        c.ids = host.ids.data_ptr()
        c.layer, c.rows, c.top_k = layer, T, A
        c.num_slots, c.stream_above = pool.num_slots, stream_above
        if job is not None:  # the prepared job's buffers: x, ids, w, out
            x, ids, w, out, _, _ = job.job.args
            c.executor = job.executor.handle
            c.x, c.cpu_ids, c.w, c.cpu_out = x, ids, w, out
            c.cpu_signal = host.cpu_done or None  # the graph's flag for the CPU's result
        self.job = job
        (c.needed, c.uses, c.slot, c.fetched, c.fetched_slots) = (
            int(self.out[r].ctypes.data) for r in range(5))
        c.dst_rows, c.src_rows = (int(self.rows[r].ctypes.data) for r in range(2))
        c.table, c.staged, c.device_table, c.table_bytes = pool.table_buffers(layer)
        c.rule.held, c.rule.share = True, 1.0  # every miss fetched, unless a split's rule
        c.incoming, c.experts = incoming.address, incoming.experts
        self.ahead = self._ahead(lookahead, pool, rt, T, A)
        self._ref = ctypes.byref(c)
        self.fetch: Span | None = None  # the last call's copies
        self.prefetch: Span | None = None  # the last call's look-ahead copies
        self._armed: tuple[Span | None, Span | None] | None = None  # by :meth:`arm`

    def _ahead(self, la: Lookahead | None, pool: NativeSlotPool, rt: OffloadRuntime, T: int,
               A: int) -> Lookahead | None:
        """Look-ahead made in the call (``c.ahead``) on the next router's picks that come with
        the host copies, where the next layer's slot decisions are the library's too; None
        where it is not (then the caller makes it in Python)."""
        picks = self.host.predicted
        if la is None or picks is None:
            return None
        target, to = la.target, rt.cache.pool(la.layer)
        if not isinstance(to, NativeSlotPool) or target.bank is None:
            return None
        if target.incoming.experts != len(to.tables[la.layer]):
            raise ValueError(f"layer {la.layer}: look-ahead's lists hold "
                             f"{target.incoming.experts} experts, its table "
                             f"{len(to.tables[la.layer])}")
        if picks.dtype is not torch.int64 or not picks.is_contiguous() or picks.is_cuda:
            raise ValueError("look-ahead reads int64 picks on the host, contiguous")
        a = self.c.ahead
        a.slots, a.picks, a.layer, a.n_picks = to.handle, picks.data_ptr(), la.layer, picks.numel()
        a.same_pool, a.experts = to is pool, target.incoming.experts
        a.incoming = target.incoming.address
        rows_of(a.copy, to.data, target.bank.rows, rt)
        n = picks.numel()
        self.ahead_out = np.empty((5, max(n, 2 * T * A)), dtype=np.int64)  # keep, 4 outputs
        self.ahead_rows = np.empty((2, n), dtype=np.int32)
        (a.keep, a.predicted, a.slot, a.fetched, a.fetched_slots) = (
            int(self.ahead_out[r].ctypes.data) for r in range(5))
        a.dst_rows, a.src_rows = (int(self.ahead_rows[r].ctypes.data) for r in range(2))
        self.expert_bytes = target.bank.expert_bytes
        return la

    def arm(self) -> None:
        """What :meth:`run` sets that needs no inputs: look-ahead's rule (the next layer's
        share now) and, on a GPU, the copies' events. A host step's prepare calls it before
        the inputs arrive; else :meth:`run` does."""
        c, rt, la = self.c, self.rt, self.ahead
        fetches = False  # whether look-ahead may fetch at all for this call
        if la is not None:
            rule, budget = la.target.prefetch_rule(), la.budget(c.rows)
            rule.write(c.ahead.rule, budget)
            fetches = budget > 0 and rule.count(budget) > 0
        if self._armed is not None:  # events taken for a call that did not run: this one's
            return
        span = ahead = None
        if rt.cuda:
            span = Span(rt.copy_stream, rt.events)
            c.ev_start, c.ev_end = span.start.cuda_event, span.end.cuda_event
            if fetches:
                ahead = Span(rt.copy_stream, rt.events)
            c.ahead.ev_start = None if ahead is None else ahead.start.cuda_event
            c.ahead.ev_end = None if ahead is None else ahead.end.cuda_event
        self._armed = (span, ahead)

    def run(self) -> int:
        """Plan the call: 0 (planned: :attr:`fetch` is its copies' span, or None; with
        look-ahead, :attr:`prefetch` its copies') or :data:`STREAMS` (routed only, nothing
        fetched: the caller streams). The incoming prediction is scored either way."""
        c, rt, la = self.c, self.rt, self.ahead
        if self._armed is None:
            self.arm()
        assert self._armed is not None
        (span, ahead), self._armed = self._armed, None
        if rt.cuda:
            c.copy.compute_stream = current_stream(rt.index)
            c.wait_first = None if rt.copied is None else rt.copied.cuda_event
        code = self._plan(self._ref)
        if code < 0:
            for s in (span, ahead):
                if s is not None:
                    rt.events.give(s.start, s.end)
            self._raise(code)
        if code == 0 and rt.cuda:
            rt.copied = None  # the compute stream waits for every copy queued so far
        self.fetch = self._span(span, c.n_fetched if code == 0 else 0, c.copy_ns)
        if c.la_predicted >= 0:
            rt.stats.record_lookahead(c.layer, c.la_predicted, c.la_used, c.n_needed)
        self.prefetch = None
        if la is not None:
            n = c.ahead.n_fetched if code == 0 else 0
            self.prefetch = self._span(ahead, n, c.ahead.copy_ns)
            if self.prefetch is not None:
                if rt.cuda:  # left for the next call's compute to wait for
                    rt.copied = self.prefetch.end
                rt.stats.record_prefetch(la.layer, n, n * self.expert_bytes, self.prefetch)
        return code

    def _span(self, span: Span | None, n: int, copy_ns: int) -> Span | None:
        """The span of ``n`` rows copied (None where none: its events go back); on the CPU
        the copies' host time."""
        if not n:
            if span is not None:
                self.rt.events.give(span.start, span.end)
            return None
        if span is None:
            span = Span(None)
            span.seconds = copy_ns / 1e9
        return span

    def _raise(self, code: int) -> None:
        c = self.c
        if code == -1:
            ids = self.host.ids.reshape(-1).tolist()
            raise ValueError(f"expert cache: layer {c.layer} was routed to an expert it lacks "
                             f"({ids})")
        if code == -2:
            raise RuntimeError(f"expert cache: {c.num_slots} slots, none left to evict")
        if code == -3:
            raise ValueError(f"layer {c.layer}: the CPU pool refused the call's job")
        if code == -4:
            raise RowCopyError("the CUDA driver's entry points for the copies are incomplete")
        if code == -5:
            picks = self.host.predicted
            raise ValueError(f"expert cache: layer {c.ahead.layer} has no experts "
                             f"{None if picks is None else picks.reshape(-1).tolist()}")
        raise RowCopyError(f"layer {c.layer}: copying {c.n_fetched} expert rows (and "
                           f"{c.ahead.n_fetched} for layer {c.ahead.layer}'s look-ahead) failed: "
                           f"CUDA driver error {DRIVER_ERROR - code}")

    def routed(self) -> Routed:
        """The call's experts, their uses and slots (before the split), as the pool's route
        gives them (views of this call's buffers)."""
        k, out = self.c.n_needed, self.out
        return Routed(out[0, :k], out[1, :k], out[2, :k], self.c.misses)

    def split(self) -> Split:
        """The fetched misses and their slots (views), and how many went to the CPU."""
        n, out = self.c.n_fetched, self.out
        return Split(out[3, :n], out[4, :n], self.c.n_cpu)


class LayerCalls:
    """One layer's :class:`LayerCall` per set of host copies (a decode graph's, per batch
    size), made at its first call by ``make`` (None: those copies take the Python plan)."""

    def __init__(self, make: Callable[[HostCopies], LayerCall | None]) -> None:
        self._make = make
        self._calls: dict[int, tuple[HostCopies, LayerCall | None]] = {}  # by id(host)

    def get(self, host: HostCopies) -> LayerCall | None:
        found = self._calls.get(id(host))
        if found is None:  # the copies are kept with their call: their id stays theirs
            found = self._calls[id(host)] = (host, self._make(host))
        return found[1]


def rows_of(into: abi.RowCopy, dst: torch.Tensor, src: torch.Tensor, rt: OffloadRuntime) -> None:
    """``into`` copies rows of ``src`` (a host bank) into rows of ``dst`` (a pool's slots),
    on ``rt``'s copy stream after its ready event."""
    if dst.shape[1] != src.shape[1] or dst.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("a layer call copies contiguous rows of one size")
    into.dst, into.dst_stride = dst.data_ptr(), dst.stride(0)
    into.src, into.src_stride = src.data_ptr(), src.stride(0)
    into.row_bytes = dst.shape[1]
    if rt.cuda:
        assert rt.copy_stream is not None and rt.ready is not None
        into.copy_stream = rt.copy_stream.cuda_stream
        into.ev_ready = rt.ready.cuda_event


def library_plans(pool: SlotPool, rt: OffloadRuntime) -> bool:
    """Whether the library plans a layer's calls on ``pool``: it makes the pool's slot
    decisions and the runtime's copies, and FREETOKEN_LAYER_CALL allows."""
    return (isinstance(pool, NativeSlotPool) and rt.rows is not None
            and env.layer_call() == "native")
