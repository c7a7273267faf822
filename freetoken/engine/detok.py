"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Feed token ids one at a time; get back only the newly completed text.

    Decodes a short window of recent tokens rather than the whole output, so the cost per token
    stays constant; holds text back while it ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into emitted text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""
