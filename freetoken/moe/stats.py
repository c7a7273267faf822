"""Per-layer MoE statistics: cache hits and misses, bytes fetched, time in fetch and compute.

Times on CUDA come from event pairs recorded on the stream that did the work and are read when
they have completed (at the next snapshot), so recording never waits for the GPU.
Threads: ``record``/``timed`` on the engine's main thread; ``snapshot`` on the same thread.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class LayerStats:
    calls: int = 0
    tokens: int = 0
    hits: int = 0
    misses: int = 0
    streamed: int = 0  # experts read through the prefill stream, not the cache
    bytes_fetched: int = 0
    fetch_s: float = 0.0
    compute_s: float = 0.0  # expert-by-expert calls (gathered ones run inside the step's graph)
    plan_s: float = 0.0  # host seconds from a gathered call's routed ids to its plan's end
    # (the copies and slot table queued; hybrid's wait for the CPU comes after)
    cpu_experts: int = 0  # misses computed on the CPU (hybrid)
    cpu_s: float = 0.0  # the CPU pool's time on its jobs, submit to last item (hybrid)
    prefetched: int = 0  # experts look-ahead fetched for this layer (in bytes_fetched too)
    lookahead_predicted: int = 0  # experts the layer before predicted for this one's calls
    lookahead_used: int = 0  # of those, the experts the calls routed to
    lookahead_needed: int = 0  # experts those calls routed to (used / needed: the hit rate)


KIND_TIMES = ("fetch_s", "compute_s", "cpu_s", "plan_s")  # summed per layer kind
# spans read per recorded call at most, oldest first, while they have finished: their events go
# back to the pool for the next copies (an empty pool makes two events a span, each a driver
# call and a record: on the H100 cProfile put 20 us on each take, 3.6 takes a layer call)
DRAIN_PER_CALL = 4


class EventPool:
    """Timing events made once and reused by spans whose events something else records (the
    library's row copies on the copy stream). An event comes back once its span has been
    read; only copy-stream spans take from one pool, so an event waited on after it came back
    was recorded again later on that same stream, and the wait only waits longer."""

    def __init__(self) -> None:
        self.free: list[torch.cuda.Event] = []

    def take(self) -> torch.cuda.Event:
        if self.free:
            return self.free.pop()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # made now, so that it has a handle (torch makes events lazily)
        return event

    def give(self, *events: torch.cuda.Event) -> None:
        self.free.extend(events)


class Span:
    """One timed piece of work: host clock on the CPU, an event pair on CUDA (recorded here,
    or, from an :class:`EventPool`, by whoever does the work)."""

    def __init__(self, stream: torch.cuda.Stream | None, pool: EventPool | None = None) -> None:
        self.stream = stream
        self.pool = pool
        self.seconds: float | None = None
        if stream is None:
            self.t0 = time.perf_counter()
        elif pool is not None:
            self.start, self.end = pool.take(), pool.take()
        else:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record(stream)

    def stop(self) -> Span:
        if self.stream is None:
            self.seconds = time.perf_counter() - self.t0
        elif self.pool is None:
            self.end.record(self.stream)
        return self

    def done(self) -> float | None:
        """Seconds, or None while the GPU has not finished the span."""
        if self.stream is None or self.seconds is not None:
            return self.seconds
        if not self.end.query():
            return None
        seconds = self.start.elapsed_time(self.end) / 1e3
        if self.pool is not None:  # read once: the events go back
            self.seconds = seconds
            self.pool.give(self.start, self.end)
        return seconds


class MoEStats:
    """Counters of every offloaded layer of one model."""

    def __init__(self, layers: list[int], cuda: bool,
                 kinds: dict[int, str] | None = None) -> None:
        self.layers = {layer: LayerStats() for layer in layers}
        self.kinds = kinds or {}  # layer -> its expert formats in words (``q8_0``, ``bf16``)
        self.first = min(layers) if layers else -1
        self.cuda = cuda
        self._pending: list[tuple[int, str, Span]] = []
        self.fractions: dict[int, float | None] = {}  # hybrid layers: live fetch fraction

    def set_fraction(self, layer: int, fraction: float | None) -> None:
        self.fractions[layer] = fraction

    def span(self, stream: torch.cuda.Stream | None = None) -> Span:
        if self.cuda and stream is None:
            stream = torch.cuda.current_stream()
        return Span(stream if self.cuda else None)

    def record(self, layer: int, tokens: int, hits: int, misses: int, nbytes: int,
               streamed: int = 0, fetch: Span | None = None, compute: Span | None = None,
               cpu_experts: int = 0, cpu_s: float = 0.0, plan_s: float = 0.0) -> None:
        """One layer call: ``misses`` are the experts fetched into the cache."""
        s = self.layers[layer]
        s.plan_s += plan_s
        s.cpu_experts += cpu_experts
        s.cpu_s += cpu_s
        s.calls += 1
        s.tokens += tokens
        s.hits += hits
        s.misses += misses
        s.streamed += streamed
        s.bytes_fetched += nbytes
        for kind, span in (("fetch_s", fetch), ("compute_s", compute)):
            if span is not None:
                self._pending.append((layer, kind, span))
        self._drain()
        if len(self._pending) > 4096:
            self._collect(block=True)

    def record_cpu(self, layer: int, seconds: float) -> None:
        """The CPU pool's time on a call :meth:`record` counted before its job was done."""
        self.layers[layer].cpu_s += seconds

    def record_prefetch(self, layer: int, experts: int, nbytes: int, fetch: Span) -> None:
        """Look-ahead fetched ``experts`` for ``layer``'s next call."""
        s = self.layers[layer]
        s.prefetched += experts
        s.bytes_fetched += nbytes
        self._pending.append((layer, "fetch_s", fetch))

    def record_lookahead(self, layer: int, predicted: int, used: int, needed: int) -> None:
        """A call of ``layer`` scored the prediction made for it."""
        s = self.layers[layer]
        s.lookahead_predicted += predicted
        s.lookahead_used += used
        s.lookahead_needed += needed

    def _drain(self) -> None:
        """The oldest pending spans read while they have finished, DRAIN_PER_CALL at most (no
        wait: the first still running stops it), so that their events return to the pool as
        the calls go, not at the next snapshot."""
        pending, n = self._pending, 0
        while n < min(DRAIN_PER_CALL, len(pending)):
            layer, kind, span = pending[n]
            seconds = span.done()
            if seconds is None:
                break
            self._add(layer, kind, seconds)
            n += 1
        if n:
            del pending[:n]

    def _collect(self, block: bool = False) -> None:
        keep = []
        for layer, kind, span in self._pending:
            if block and span.stream is not None:
                span.end.synchronize()
            seconds = span.done()
            if seconds is None:
                keep.append((layer, kind, span))
            else:
                self._add(layer, kind, seconds)
        self._pending = keep

    def _add(self, layer: int, kind: str, seconds: float) -> None:
        """A read span's seconds added to its layer's ``kind`` (``fetch_s``, ``compute_s``)."""
        setattr(self.layers[layer], kind, getattr(self.layers[layer], kind) + seconds)

    def snapshot(self, per_layer: bool = True) -> dict[str, Any]:
        """Totals (hit rate, bytes per token over the link, seconds) and, if asked, per layer."""
        self._collect()
        tot = LayerStats()
        for s in self.layers.values():
            for k, v in asdict(s).items():
                setattr(tot, k, getattr(tot, k) + v)
        lookups = tot.hits + tot.misses + tot.cpu_experts
        tokens = self.layers[self.first].tokens if self.layers else 0
        out: dict[str, Any] = {
            **asdict(tot),
            "tokens": tokens,
            "hit_rate": tot.hits / lookups if lookups else 0.0,
            "bytes_per_token": tot.bytes_fetched / tokens if tokens else 0.0,
            "lookahead_hit_rate": _rate(tot),
        }
        kinds: dict[str, dict[str, float]] = {}
        for layer, s in self.layers.items():
            kind = self.kinds.get(layer)
            if kind is None:
                continue
            row = kinds.setdefault(kind, {"layers": 0, **{k: 0.0 for k in KIND_TIMES}})
            row["layers"] += 1
            for k in KIND_TIMES:
                row[k] += getattr(s, k)
        if kinds:
            out["kinds"] = kinds
        if per_layer:
            out["layers"] = {str(k): asdict(v) | {"lookahead_hit_rate": _rate(v)}
                             for k, v in self.layers.items()}
            for k, f in self.fractions.items():
                out["layers"][str(k)]["fetch_fraction"] = f
        return out


def _rate(s: LayerStats) -> float | None:
    """The share of routed experts look-ahead had predicted (None: nothing predicted)."""
    return s.lookahead_used / s.lookahead_needed if s.lookahead_needed else None
