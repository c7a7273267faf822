"""Server-sent events and text-level stop strings."""

from __future__ import annotations

import json
from typing import Any


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class StopMatcher:
    """Cuts generated text at the first stop string and holds back text that might begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything generated so far
        self.sent = 0  # characters of text already released

    def push(self, delta: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to release now, whether a stop was hit)."""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0:
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
