"""The prefill stream: a call that misses most of a layer's experts (a prefill chunk) reads
them through two staging buffers on the device instead of the expert cache, which it leaves
alone. The copy of chunk k+1 overlaps the compute of chunk k. Each expert is dequantised before
its matmuls, one by one; with FREETOKEN_PREFILL_DEQUANT=chunk a chunk's experts are
dequantised together, a projection at a time (the same values: the formats' dequantisation is
elementwise). On an H100 the one-by-one way filled the prompt's time: 8 of the 48
qwen3-30b-a3b q8_0 layers took 0.32 s for a 512-token prompt, of which 0.12 s were some 7,000
small copies and 0.10 s the link's 946 experts; the chunk's way is not yet measured there."""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken import env
from freetoken.kernels.expert_matmul import Weights
from freetoken.moe.host_banks import HostBank
from freetoken.moe.runtime import STREAM_CHUNK, OffloadRuntime
from freetoken.moe.stats import Span

DEQUANT_BYTES = 512 << 20  # the most float32 weight bytes a stream dequantises at once


class PrefillStream:
    """Misses of one call, in ascending order, through two staging buffers of STREAM_CHUNK rows:
    chunk k+1 is copied while chunk k is computed; chunk k+2 reuses chunk k's buffer once its
    compute is done."""

    def __init__(self, rt: OffloadRuntime, bank: HostBank, misses: list[int]) -> None:
        self.rt, self.bank = rt, bank
        self.buffers = rt.staging(bank.expert_bytes)
        self.chunks = [misses[i:i + STREAM_CHUNK] for i in range(0, len(misses), STREAM_CHUNK)]
        self.where = {e: (k, i) for k, c in enumerate(self.chunks) for i, e in enumerate(c)}
        self.loaded: dict[int, torch.cuda.Event | None] = {}
        self.used: dict[int, torch.cuda.Event] = {}  # chunk -> end of its compute
        self.spans: list[Span] = []
        self.current = -1
        # experts dequantised at once (FREETOKEN_PREFILL_DEQUANT=chunk): a chunk, or fewer
        # where their float32 weights would pass DEQUANT_BYTES; else one at a time
        elements = sum(rows * cols for rows, cols in bank.layout.shapes)
        self.group = (max(1, min(STREAM_CHUNK, DEQUANT_BYTES // (4 * elements)))
                      if env.prefill_dequant() == "chunk" else 1)
        self.dequantised: tuple[tuple[int, int], Weights] | None = None  # (chunk, group)
        if self.chunks:
            self._load(0)

    def _load(self, k: int) -> None:
        after = self.used.get(k - 2)
        span, done = self.rt.copy(self.buffers[k % 2], list(range(len(self.chunks[k]))),
                                  self.bank, self.chunks[k], after)
        self.spans.append(span)
        self.loaded[k] = done

    def weights(self, e: int, weights: Callable[[torch.Tensor], Weights]) -> Weights:
        """Expert ``e``'s weights: its group's rows (``group`` of its chunk's) given to
        ``weights`` at once (stacked projections, one row per expert) when the group is first
        read, then its slices; one at a time, the row itself."""
        if self.group == 1:
            return weights(self.row(e))
        k, i = self.where[e]
        self.row(e)  # the chunk current and loaded
        key = (k, i // self.group)
        if self.dequantised is None or self.dequantised[0] != key:
            lo = key[1] * self.group
            rows = self.buffers[k % 2][lo : min(lo + self.group, len(self.chunks[k]))]
            self.dequantised = (key, weights(rows))
        gate, up, down = self.dequantised[1]
        j = i % self.group
        return gate[j], up[j], down[j]

    def row(self, e: int) -> torch.Tensor:
        k, i = self.where[e]
        if k != self.current:
            if self.current >= 0 and self.rt.cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream())
                self.used[self.current] = ev
            self.current = k
            if k + 1 < len(self.chunks) and k + 1 not in self.loaded:
                self._load(k + 1)
            self.rt.wait(self.loaded[k])
        return self.buffers[k % 2][i]

    def finish(self) -> Span | None:
        """The span of the copies (first start to last end) for the stats."""
        if not self.spans:
            return None
        first, last = self.spans[0], self.spans[-1]
        if first.stream is None:
            first.seconds = sum(s.seconds or 0.0 for s in self.spans)
            return first
        first.end = last.end
        return first


def streamed_call(rt: OffloadRuntime, bank: HostBank, layer: int, tokens: int,
                  hits: dict[int, torch.Tensor], misses: list[int],
                  compute: Callable[[Callable[[int], Weights]], torch.Tensor],
                  weights: Callable[[torch.Tensor], Weights]) -> torch.Tensor:
    """One call of ``tokens`` tokens with ``misses`` streamed and ``hits`` (expert -> its
    slot's row) read in place: ``compute`` runs the call's experts, given each expert's weights
    (``weights`` of a row, or of stacked rows: one leading dimension more on each projection);
    the call's counts go to the runtime's stats."""
    rt.wait_copies()  # hits that look-ahead fetched (before the stream's own copies)
    stream = PrefillStream(rt, bank, misses)
    span = rt.stats.span()
    out = compute(lambda e: weights(hits[e]) if e in hits else stream.weights(e, weights))
    rt.stats.record(layer, tokens, len(hits), 0, len(misses) * bank.expert_bytes,
                    streamed=len(misses), fetch=stream.finish(), compute=span.stop())
    return out
