"""What all offloaded layers of one model share: the expert cache, the copy stream that fills
it over the link, the stats, and the prefill stream's staging buffers.

A decode call's misses go bank -> slots through :meth:`OffloadRuntime.fetch`: one call into
the library (``cpu/row_copy.py``) that queues the copies and their stream ordering, or, where
the library or the CUDA driver is not there or ``FREETOKEN_ROW_COPY=torch``, torch's copies
(:meth:`OffloadRuntime.copy`, also the prefill stream's and the bandwidth bench's path).

Threads: the engine's main thread only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from freetoken import env
from freetoken.cpu.library import NativeUnavailable
from freetoken.cpu.row_copy import RowCopier, current_stream
from freetoken.moe.expert_cache import ExpertCache
from freetoken.moe.host_banks import HostBank
from freetoken.moe.pieces import Recorder
from freetoken.moe.split import SplitCosts
from freetoken.moe.stats import EventPool, MoEStats, Span

log = logging.getLogger(__name__)

STREAM_CHUNK = 8  # experts per staging buffer of the prefill stream


class OffloadRuntime(Recorder):
    """What all offloaded layers of one model share: the cache, the copy stream, the stats and
    the staging buffers of the prefill stream. Made by ``moe/attach.py`` when a layer needs a
    device cache."""

    def __init__(self, cache: ExpertCache, stats: MoEStats, device: torch.device) -> None:
        self.cache, self.stats, self.device = cache, stats, device
        self.cuda = device.type == "cuda"
        super().__init__(row_copier(self.cuda))
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging: dict[int, list[torch.Tensor]] = {}
        self.copied: torch.cuda.Event | None = None  # the end of the last copy not waited for
        self.events = EventPool()  # the library's copy spans (CUDA)
        self.ready = self.events.take() if self.rows is not None and self.cuda else None
        self.index = torch.device(device).index or 0 if self.cuda else -1
        for pool in cache.pools:  # slot tables published through the library too
            pool.copier = self.rows
        self.splits: dict[Any, SplitCosts] = {}  # hybrid's, per layer kind (``Shared.splits``)

    def fetch_every_miss(self, on: bool) -> None:
        """Whether the calls of the next steps, until told otherwise, fetch every miss whatever
        hybrid's split (``--moe-hybrid-greedy fetch``: a step with a greedy sequence in its
        batch): an expert computed on the CPU differs from the device's in the last bits, so
        greedy text would move with the times the split measures; fetched, it is offload's,
        which is resident's."""
        for costs in self.splits.values():
            costs.fetch_all = on

    def staging(self, row_bytes: int) -> list[torch.Tensor]:
        if row_bytes not in self._staging:
            self._staging[row_bytes] = [
                torch.empty(STREAM_CHUNK, row_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(2)]
        return self._staging[row_bytes]

    def copy(self, dst: torch.Tensor, dst_rows: list[int], bank: HostBank,
             experts: list[int], after: torch.cuda.Event | None = None,
             ) -> tuple[Span, torch.cuda.Event | None]:
        """Copy bank rows ``experts`` into ``dst`` rows ``dst_rows``. On CUDA the copies run on
        the copy stream after the compute stream's work so far (and ``after``); the returned
        event marks their end, for the compute stream to wait on."""
        if self.copy_stream is None:
            span = self.stats.span()
            for r, e in zip(dst_rows, experts, strict=True):
                dst[r].copy_(bank.rows[e])
            return span.stop(), None
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        if after is not None:
            self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            span = self.stats.span(self.copy_stream)
            for r, e in zip(dst_rows, experts, strict=True):
                dst[r].copy_(bank.rows[e], non_blocking=True)
            span.stop()
        self.copied = span.end
        return span, span.end  # the span's end event marks the copies' end

    def fetch(self, dst: torch.Tensor, dst_rows: list[int], bank: HostBank,
              experts: list[int], wait: bool) -> Span:
        """Bank rows ``experts`` into cache rows ``dst_rows``, after the compute stream's work
        so far. ``wait``: the compute stream then waits for them and for every copy queued
        before (a call's own misses); else they are left for :meth:`wait_copies` (what
        look-ahead fetches for the next layer)."""
        if self.rows is None:
            span, _ = self.copy(dst, dst_rows, bank, experts)
            if wait:
                self.wait_copies()
            return span
        if self.copy_stream is None:
            span = self.stats.span()
            self.rows.copy(dst, dst_rows, bank.rows, experts)
            return span.stop()
        assert self.ready is not None
        span = Span(self.copy_stream, self.events)
        self.rows.copy(dst, dst_rows, bank.rows, experts,
                       current_stream(self.index), self.copy_stream.cuda_stream,
                       self.ready.cuda_event, span.start.cuda_event, span.end.cuda_event,
                       compute_waits=wait)
        # the copy stream runs in order: this span's end covers every copy before it
        self.copied = None if wait else span.end
        return span

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def wait_copies(self) -> None:
        """The compute stream waits for every copy queued so far (the copy stream runs them
        in order): a call's own fetches and what look-ahead fetched for it earlier."""
        event, self.copied = self.copied, None
        self.wait(event)


def row_copier(cuda: bool) -> RowCopier | None:
    """The library's row copier, or None (torch's copies) with the reason logged."""
    if env.row_copy() == "torch":
        return None
    try:
        return RowCopier(cuda)
    except NativeUnavailable as e:
        log.info("expert fetches use torch's copies: %s", e)
        return None
