"""GPT-OSS's harmony format: an output is a sequence of messages on named channels.

Each message is ``<|start|>{header}<|message|>{body}`` closed by ``<|end|>``, ``<|call|>`` (a
tool call; generation stops) or ``<|return|>`` (the final answer; generation stops). The header
holds the role, ``<|channel|>NAME`` and for a tool call the recipient ``to=functions.NAME`` (in
the role part or after the channel) and ``<|constrain|>json``. The prompt ends with
``<|start|>assistant``, so the first message's header comes without its ``<|start|>``.

Channels: ``analysis`` is reasoning; ``final`` is the answer; ``commentary`` is a tool call when
the header names a recipient and a preamble the user sees when it does not. Every marker here is
a special token: the output must be decoded with special tokens kept.
"""

from __future__ import annotations

import re

from .base import OutputParser
from .events import ContentDelta, ReasoningDelta
from .jsoncall import arguments_json
from .scan import BodyScanner, find_marker

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
CONSTRAIN = "<|constrain|>"  # in a call's header: the body's format follows
CLOSERS = (END, CALL, RETURN, START, CHANNEL)
# A header is a role, a channel, a recipient and a content type: a line, not a paragraph. Past
# this many characters without <|message|> the text was never a header.
HEADER_LIMIT = 256
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def read_header(head: str) -> tuple[str, str | None]:
    """``(channel, tool name or None)`` of a message header."""
    channel = _CHANNEL.search(head)
    recipient = _RECIPIENT.search(head)
    name = recipient.group(1) if recipient else None
    if name is not None:
        name = name.removeprefix("functions.")
    return (channel.group(1) if channel else "final"), (name or None)


class HarmonyParser(OutputParser):
    name = "gpt_oss"
    anchor = "<|start|>assistant"
    special_tokens = True

    # The prompt ended with "<|start|>assistant": the first header is already open.
    state = "header"  # or "body", "call", "idle" (between messages)
    head = ""  # the open message's header text, markers included
    kind: type[ReasoningDelta] | type[ContentDelta] = ContentDelta  # the open body's
    tool: str | None = None  # the open call's function

    def _step(self, final: bool) -> None:
        while self._advance(final):
            pass

    def _advance(self, final: bool) -> bool:
        if self.state == "header":
            return self._header_step(final)
        if self.state == "call":
            return self._call_step(final)
        kind = self.kind if self.state == "body" else ContentDelta
        marker = self._plain_step(kind, CLOSERS, final)
        if marker is None:
            return False
        self._open(marker)
        return True

    def _open(self, marker: str) -> None:
        """After ``marker``, a new header starts (``<|start|>``, ``<|channel|>``) or nothing."""
        if marker in (START, CHANNEL):
            self.state, self.head = "header", marker
        else:
            self.state = "idle"

    def _header_step(self, final: bool) -> bool:
        i, marker = find_marker(self.buf, (MESSAGE,))
        if marker is None:
            take = len(self.buf) if final else i
            self.head += self.buf[:take]
            self.buf = self.buf[take:]
            if not final and len(self.head) <= HEADER_LIMIT:
                return False
            self._begin(ContentDelta)
            self._text(ContentDelta, self.head)
            self.state, self.head = "idle", ""
            return not final
        self.head += self.buf[:i]
        self.buf = self.buf[i + len(marker):]
        channel, self.tool = read_header(self.head)
        if self.tool is not None:
            self.state = "call"
            self.scanner = BodyScanner(CLOSERS, ('"',), "\\")
        else:
            self.state = "body"
            self.kind = ReasoningDelta if channel == "analysis" else ContentDelta
            self._begin(self.kind)
        return True

    def call_opener(self, name: str | None) -> str | None:
        """A commentary message to ``functions.NAME`` whose header is written up to its JSON
        body; without a name, up to ``functions.`` (the model writes the name and the rest of
        the header). A message the prompt left open is ended first."""
        lead = {"header": "", "idle": START + "assistant"}.get(self.state,
                                                              END + START + "assistant")
        header = CHANNEL + "commentary to=functions."
        return lead + header + ("" if name is None else f"{name} {CONSTRAIN}json{MESSAGE}")

    def thought_closer(self) -> str | None:
        """The analysis message ended and a final one's header written up to its body."""
        if self.state != "body" or self.kind is not ReasoningDelta:
            return None
        return END + START + "assistant" + CHANNEL + "final" + MESSAGE

    def _call_step(self, final: bool) -> bool:
        tool = self.tool
        assert tool is not None

        def parse(body: str) -> list[tuple[str, str]] | None:
            args = arguments_json(body)
            return None if args is None else [(tool, args)]

        closer = self._close_call(self.head + MESSAGE, parse, final)
        if closer is None:
            return False
        self.head = ""
        self._open(closer)
        return closer != ""
