"""Families with no reasoning or tool-call markup: every byte is content, as it came."""

from __future__ import annotations

from .base import OutputParser
from .events import ContentDelta


class PlainParser(OutputParser):
    name = "plain"
    trims = False

    def _step(self, final: bool) -> None:
        self._text(ContentDelta, self.buf)
        self.buf = ""
