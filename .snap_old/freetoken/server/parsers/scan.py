"""Finding markup in text that arrives in pieces.

Two questions every parser asks of its buffer: where is the next marker, and how much of the
tail must wait because it could still grow into one. ``find_marker`` answers both for plain
text; ``BodyScanner`` answers them inside a tool call's body, where a closing marker written
inside a string literal is data, not the end of the call.
"""

from __future__ import annotations

from collections.abc import Sequence


def partial_tail(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is the start (not all) of some marker."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), longest, -1):
            if buf.endswith(m[:k]):
                longest = k
                break
    return longest


def find_marker(buf: str, markers: Sequence[str]) -> tuple[int, str | None]:
    """``(index, marker)`` of the earliest marker in ``buf``; without one, ``(safe, None)`` where
    ``buf[:safe]`` is text and ``buf[safe:]`` could still begin a marker.

    Markers of one parser never overlap (none is a prefix of another), so the earliest complete
    match is the only reading.
    """
    best, found = len(buf), None
    for m in markers:
        i = buf.find(m, 0, best + len(m))
        if i >= 0 and (found is None or i < best):
            best, found = i, m
    if found is not None:
        return best, found
    return len(buf) - partial_tail(buf, markers), None


class BodyScanner:
    """Finds the marker that closes a tool call's body, skipping string literals.

    State survives between calls, so each character is read once however the body is fed.
    ``quotes`` open and close a literal (each closes itself); ``escape`` makes the next
    character literal. Scanning stops short of any tail that could still become a marker, a
    quote or an escape, unless ``final`` says no more text will come.
    """

    def __init__(self, closers: Sequence[str], quotes: Sequence[str],
                 escape: str | None = None) -> None:
        self.closers = tuple(closers)
        self.quotes = tuple(quotes)
        self.escape = escape
        self.pos = 0
        self.quote: str | None = None

    def find(self, body: str, final: bool) -> tuple[int, str] | None:
        i, n = self.pos, len(body)
        while i < n:
            if self.quote is not None:
                if self.escape is not None and body[i] == self.escape:
                    if i + 1 >= n and not final:
                        break
                    i += 2
                    continue
                if body.startswith(self.quote, i):
                    i += len(self.quote)
                    self.quote = None
                    continue
                if not final and self._could_start(body[i:], (self.quote,)):
                    break
                i += 1
                continue
            closer = next((c for c in self.closers if body.startswith(c, i)), None)
            if closer is not None:
                self.pos = i
                return i, closer
            quote = next((q for q in self.quotes if body.startswith(q, i)), None)
            if quote is not None:
                self.quote = quote
                i += len(quote)
                continue
            if not final and self._could_start(body[i:], (*self.closers, *self.quotes)):
                break
            i += 1
        self.pos = min(i, n)
        return None

    @staticmethod
    def _could_start(rest: str, tokens: Sequence[str]) -> bool:
        return any(len(rest) < len(t) and t.startswith(rest) for t in tokens)
