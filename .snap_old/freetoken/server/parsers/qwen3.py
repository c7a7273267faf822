"""Qwen3: reasoning in ``<think>...</think>``, tool calls as JSON in ``<tool_call>...</tool_call>``.

The chat template writes each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>``, one block per call, after any text. Thinking templates may open ``<think>`` in
the prompt itself, so generation starts inside the reasoning; ``prime`` sees that. Qwen2.5
writes tool calls the same way and simply never thinks.
"""

from __future__ import annotations

import json

from .base import OutputParser
from .events import ContentDelta, ReasoningDelta
from .jsoncall import named_call
from .scan import BodyScanner

THINK, END_THINK = "<think>", "</think>"
CALL, END_CALL = "<tool_call>", "</tool_call>"
# End-of-turn tokens, present when the output is decoded with its special tokens.
ENDS = ("<|im_end|>", "<|endoftext|>")


class Qwen3Parser(OutputParser):
    name = "qwen3"
    anchor = "<|im_start|>assistant\n"

    state = "content"  # or "reasoning", "call"

    def _step(self, final: bool) -> None:
        while True:
            if self.state == "call":
                if not self._call_step(final):
                    return
            elif self.state == "reasoning":
                marker = self._plain_step(ReasoningDelta, (END_THINK, *ENDS), final)
                if marker is None:
                    return
                if marker == END_THINK:
                    self.state = "content"
                    self._begin(ContentDelta)
            else:
                marker = self._plain_step(ContentDelta, (THINK, CALL, *ENDS), final)
                if marker is None:
                    return
                if marker == THINK:
                    self.state = "reasoning"
                    self._begin(ReasoningDelta)
                elif marker == CALL:
                    self.state = "call"
                    self.scanner = BodyScanner((END_CALL,), ('"',), "\\")

    def call_opener(self, name: str | None) -> str | None:
        """``<tool_call>\n``, then for a named tool the call's JSON up to its arguments, as
        the chat template writes a call."""
        head = self.thought_closer() or ""
        named = "" if name is None else \
            '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        return head + CALL + "\n" + named

    def thought_closer(self) -> str | None:
        return END_THINK + "\n\n" if self.state == "reasoning" else None

    def _call_step(self, final: bool) -> bool:
        """Finish the open call if its closer (or the end) is here; False while it is not."""
        def parse(body: str) -> list[tuple[str, str]] | None:
            call = named_call(body.strip())
            return None if call is None else [call]

        if self._close_call(CALL, parse, final) is None:
            return False
        self.state = "content"
        self._begin(ContentDelta)
        return True
