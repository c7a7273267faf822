"""Server-sent events and text-level stop strings."""

from __future__ import annotations

import json
from typing import Any


def sse(payload: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event; ``event`` names it (Anthropic's streams do, OpenAI's do not)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n"


class StopMatcher:
    """Cuts generated text at the first stop string and holds back text that might begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of text already released
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, delta: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to release now, whether a stop was hit)."""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if found:  # the earliest stop string wins, whatever its place in the list
            i, self.matched = min(found)
            self.text = self.text[:i]
            return self.flush(), True
        safe = len(self.text) - self.hold if self.stops else len(self.text)
        out = self.text[self.sent:max(self.sent, safe)]
        self.sent += len(out)
        return out, False

    def flush(self) -> str:
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out
