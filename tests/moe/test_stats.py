"""The offload stats read copy spans as they finish (their events go back to the pool for the
next copies), oldest first and without waiting, not only at the next snapshot."""

from __future__ import annotations

from typing import Any

from freetoken.moe.stats import DRAIN_PER_CALL, MoEStats


class _Span:
    """A span on a stream that finishes when the test says (as a CUDA event pair would)."""

    stream: Any = "copy stream"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.finished, self.reads = seconds, False, 0

    def done(self) -> float | None:
        self.reads += 1
        return self.seconds if self.finished else None


def test_finished_spans_are_read_as_the_calls_go():
    stats = MoEStats([0], cuda=True)
    spans = [_Span(1e-3 * (i + 1)) for i in range(40)]
    stuck = 10  # this one's copies run long: the spans after it wait behind it
    for i, span in enumerate(spans):
        stats.record(0, 1, 7, 1, 100, fetch=span)
        if i > 0 and i - 1 != stuck:
            spans[i - 1].finished = True  # a call's copies are done by the next call
        if i == stuck + 6:
            spans[stuck].finished = True
        pending = len(stats._pending)
        assert pending <= (8 if stuck <= i < stuck + 6 + 8 else 2), (i, pending)
    assert all(s.reads <= 3 for s in spans[:stuck])  # a few reads each, not one every call
    read = sum(s.seconds for s in spans if s.finished and s not in
               [p[2] for p in stats._pending])
    assert abs(stats.layers[0].fetch_s - read) < 1e-9
    spans[-1].finished = True
    assert stats.snapshot()["fetch_s"] == sum(s.seconds for s in spans)
    assert DRAIN_PER_CALL >= 2  # a call adds up to two spans (its copies, look-ahead's)
