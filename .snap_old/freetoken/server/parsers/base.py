"""The interface every family's output parser implements, and the emitting it shares.

A parser turns the text of one generated output into events. It is fed detokenized deltas in
order (``feed``) and told when the output ended (``finish``); it keeps back only text that could
still be the start of markup, so what it emits never has to be taken back. One parser serves one
output and is used from one thread.

Families mark up the same three things differently (reasoning, answer, tool calls), so a
subclass is only a state machine over its markers; trimming, tool-call ids and indices, the
malformed-call rule and priming from the prompt live here.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

from .events import ContentDelta, Event, ReasoningDelta, ToolCall
from .scan import BodyScanner, find_marker


def new_call_id() -> str:
    """A tool-call id unique enough to match a later tool result to its call."""
    return "call_" + uuid.uuid4().hex[:24]


class _Trim:
    """Whitespace at the edges of a region is markup's, not the model's.

    ``<think>\\nabc\\n</think>\\n\\nAnswer`` is reasoning ``abc`` and content ``Answer``: each
    segment loses its leading whitespace, and trailing whitespace waits until more text of the
    same kind shows it was inside the text rather than at its end.
    """

    def __init__(self, on: bool) -> None:
        self.on = on
        self.lead = True
        self.pending = ""

    def begin(self) -> None:
        self.lead = True

    def put(self, text: str) -> str:
        if not self.on:
            return text
        if self.lead:
            text = text.lstrip()
            if not text:
                return ""
            self.lead = False
        body = text.rstrip()
        if not body:
            self.pending += text
            return ""
        out, self.pending = self.pending + body, text[len(body):]
        return out


class OutputParser(ABC):
    """Streaming parser of one output. Subclasses set ``name`` and ``anchor`` and implement
    ``_step``; everything else is shared.

    ``tools=False`` (a request without tools) leaves tool-call markup in the content as text.
    ``new_id`` makes the ids of tool calls (tests pass a counter).
    """

    name: ClassVar[str]
    # Where the assistant's turn begins in a rendered prompt; ``prime`` reads what the template
    # wrote after it (an opened ``<think>``, an empty thought channel) to start in the right state.
    anchor: ClassVar[str | None] = None
    scanner: BodyScanner | None = None  # the open tool call's body, while one is open
    # Whether region edges are trimmed (see ``_Trim``); the passthrough parser keeps every byte.
    trims: ClassVar[bool] = True
    # Whether the family's markers are special tokens, so the output must be decoded with
    # special tokens kept (end-of-turn tokens are still dropped before the parser sees them).
    special_tokens: ClassVar[bool] = False

    def __init__(self, *, tools: bool = True, new_id: Callable[[], str] = new_call_id) -> None:
        self.buf = ""
        self.tools = tools
        self.new_id = new_id
        self.malformed_tool_call = False
        self._out: list[Event] = []
        self._calls = 0
        self._trim = {ReasoningDelta: _Trim(self.trims), ContentDelta: _Trim(self.trims)}
        self._finished = False

    def prime(self, prompt: str) -> None:
        """Read the tail of the rendered prompt after the last ``anchor`` as if generated, and
        drop what it emits: generation continues from the state the template left open."""
        at = prompt.rfind(self.anchor) if self.anchor else -1
        if at >= 0:
            self.feed(prompt[at + len(self.anchor or ""):])
            self._out.clear()

    def call_opener(self, name: str | None) -> str | None:
        """What to append to the prompt this parser was primed with so that the model's output
        is the rest of a tool call in the family's format: of tool ``name``, or of a tool the
        model names when None. It starts from the state the prompt left open (a thought still
        open is closed first). A parser primed with the prompt and the opener reads the opener
        as the start of the call. None: the family has no tool-call markup (the default)."""
        return None

    def thought_closer(self) -> str | None:
        """What ends the thought the output is in now, in the family's markup, so that what
        follows is the answer (a reasoning budget spent); None when no thought is open or the
        family has no reasoning markup (the default)."""
        return None

    def feed(self, delta: str) -> list[Event]:
        """Events that ``delta`` completes (possibly none)."""
        if self._finished:
            raise RuntimeError(f"{self.name} parser fed after finish()")
        self.buf += delta
        self._step(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The output ended: flush held-back text; an unclosed tool call is parsed as it is."""
        if not self._finished:
            self._step(final=True)
            self._finished = True
        return self._take()

    @abstractmethod
    def _step(self, final: bool) -> None:
        """Consume ``self.buf`` as far as it is decided (all of it when ``final``)."""

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _text(self, kind: type[ReasoningDelta] | type[ContentDelta], text: str) -> None:
        text = self._trim[kind].put(text)
        if text:
            self._out.append(kind(text))

    def _begin(self, kind: type[ReasoningDelta] | type[ContentDelta]) -> None:
        """A new segment of ``kind`` starts after markup: its leading whitespace is dropped."""
        self._trim[kind].begin()

    def _calls_or_text(self, raw: str, calls: Sequence[tuple[str, str]] | None) -> None:
        """A finished tool-call region: ``calls`` as ``(name, arguments JSON)`` when its body
        parsed, ``None`` when it did not; ``raw`` is the region's text with its markup."""
        if calls is None or not self.tools:
            if calls is None:
                self.malformed_tool_call = True
            self._begin(ContentDelta)
            self._text(ContentDelta, raw)
            self._begin(ContentDelta)
            return
        for name, arguments in calls:
            self._out.append(ToolCall(self._calls, self.new_id(), name, arguments))
            self._calls += 1

    def _close_call(self, opener: str,
                    parse: Callable[[str], Sequence[tuple[str, str]] | None],
                    final: bool) -> str | None:
        """The open tool call, whose body ``self.scanner`` watches, once its closer is in the
        buffer (or the output has ended inside it): the body ``parse``d into calls, or given
        back as text with ``opener`` and the closer when it does not parse, and consumed.
        Returns the closer ("" when the output ended inside the call), or None while the call
        is still open."""
        assert self.scanner is not None
        hit = self.scanner.find(self.buf, final)
        if hit is None and not final:
            return None
        end, closer = hit if hit is not None else (len(self.buf), "")
        body = self.buf[:end]
        self._calls_or_text(opener + body + closer, parse(body))
        self.buf = self.buf[end + len(closer):]
        return closer

    def _plain_step(self, kind: type[ReasoningDelta] | type[ContentDelta], markers: Sequence[str],
                    final: bool) -> str | None:
        """Emit text of ``kind`` up to the next marker and consume it; return the marker, or None
        when the buffer holds no complete one (its decided text emitted, a partial tail kept)."""
        i, marker = find_marker(self.buf, markers)
        if marker is None:
            i = len(self.buf) if final else i
            self._text(kind, self.buf[:i])
            self.buf = self.buf[i:]
            return None
        self._text(kind, self.buf[:i])
        self.buf = self.buf[i + len(marker):]
        return marker
