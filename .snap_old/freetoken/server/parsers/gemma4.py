"""Gemma 4: reasoning on the thought channel, tool calls between ``<|tool_call>`` tokens.

Reasoning is ``<|channel>thought\\n...<channel|>``; a call is ``<|tool_call>call:NAME{args}
<tool_call|>`` with the arguments in Gemma's own notation (``gemma_values``); after its calls
the model writes ``<|tool_response>`` and waits for the results. The turn ends with ``<turn|>``.
All of these are special tokens: the output must be decoded with them kept.
"""

from __future__ import annotations

import json
import re

from .base import OutputParser
from .events import ContentDelta, ReasoningDelta
from .gemma_values import QUOTE, read_value
from .scan import BodyScanner

THOUGHT, END_THOUGHT = "<|channel>thought", "<channel|>"
CALL, END_CALL = "<|tool_call>", "<tool_call|>"
ENDS = ("<turn|>", "<|tool_response>", "<eos>")
_HEAD = re.compile(r"\s*call:\s*([\w.\-]+)\s*")


def read_call(body: str) -> tuple[str, str] | None:
    """``call:NAME{...}`` as ``(name, arguments JSON)``; None if it is not one."""
    m = _HEAD.match(body)
    if m is None:
        return None
    try:
        args = read_value(body[m.end():]) if body[m.end():].strip() else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return m.group(1), json.dumps(args, ensure_ascii=False)


class Gemma4Parser(OutputParser):
    name = "gemma4"
    anchor = "<|turn>model\n"
    special_tokens = True

    state = "content"  # or "reasoning", "call"

    def _step(self, final: bool) -> None:
        while True:
            if self.state == "call":
                if not self._call_step(final):
                    return
                continue
            if self.state == "reasoning":
                marker = self._plain_step(ReasoningDelta, (END_THOUGHT, *ENDS), final)
            else:
                marker = self._plain_step(ContentDelta, (THOUGHT, CALL, *ENDS), final)
            if marker is None:
                return
            if marker == THOUGHT:
                self.state = "reasoning"
                self._begin(ReasoningDelta)
            elif marker == CALL:
                self.state = "call"
                self.scanner = BodyScanner((END_CALL,), (QUOTE,))
            else:
                self.state = "content"
                self._begin(ContentDelta)

    def call_opener(self, name: str | None) -> str | None:
        """``<|tool_call>call:``, then for a named tool its name and the arguments' ``{``."""
        head = self.thought_closer() or ""
        return head + CALL + "call:" + ("" if name is None else name + "{")

    def thought_closer(self) -> str | None:
        return END_THOUGHT if self.state == "reasoning" else None

    def _call_step(self, final: bool) -> bool:
        def parse(body: str) -> list[tuple[str, str]] | None:
            call = read_call(body)
            return None if call is None else [call]

        closer = self._close_call(CALL, parse, final)
        if closer is None:
            return False
        self.state = "content"
        self._begin(ContentDelta)
        return closer != ""
