"""Incremental detokenization: text deltas that never split a multi-byte character."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class Detokenizer:
    """Feed token ids one at a time; get back only the newly completed text.

    Decodes a short window of recent tokens rather than the whole output, so the cost per token
    stays constant; holds text back while it ends in an incomplete UTF-8 sequence.

    Special tokens are skipped unless ``keep_special`` (an output parser that reads markers
    which are special tokens); ``hidden`` ids never become text either way (end-of-turn tokens,
    which are no part of the answer).
    """

    def __init__(self, tokenizer: Any, *, keep_special: bool = False,
                 hidden: Iterable[int] = ()) -> None:
        self.tok = tokenizer
        self.skip_special = not keep_special
        self.hidden = frozenset(hidden)
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens already turned into emitted text

    def push(self, token: int) -> str:
        if token in self.hidden:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special) if ids else ""
