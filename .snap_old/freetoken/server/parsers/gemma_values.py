"""Gemma 4's notation for tool-call arguments, read into Python values.

It is JSON's shape with two differences: object keys are bare words, and strings are enclosed
by the ``<|"|>`` token instead of quotes (so they need no escapes):
``{location:<|"|>Paris<|"|>,days:3,units:[<|"|>C<|"|>]}``. Anything else is a ``ValueError``:
a call we cannot read is returned as text, not guessed at.
"""

from __future__ import annotations

import json
import re
from typing import Any

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORD = re.compile(r"[A-Za-z_][\w.\-]*")
_LITERALS = {"true": True, "false": False, "null": None}


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def expect(self, s: str) -> None:
        self.skip()
        if not self.text.startswith(s, self.i):
            raise ValueError(f"expected {s!r} at {self.i} in {self.text!r}")
        self.i += len(s)

    def peek(self, s: str) -> bool:
        self.skip()
        return self.text.startswith(s, self.i)

    def string(self) -> str:
        self.expect(QUOTE)
        end = self.text.find(QUOTE, self.i)
        if end < 0:
            raise ValueError(f"unclosed string in {self.text!r}")
        s, self.i = self.text[self.i:end], end + len(QUOTE)
        return s

    def key(self) -> str:
        if self.peek(QUOTE):
            return self.string()
        m = _WORD.match(self.text, self.i)
        if m is None:
            raise ValueError(f"expected a key at {self.i} in {self.text!r}")
        self.i = m.end()
        return m.group()

    def items(self, close: str, item: Any) -> None:
        if self.peek(close):
            self.i += len(close)
            return
        while True:
            item()
            if self.peek(","):
                self.i += 1
                continue
            self.expect(close)
            return

    def value(self) -> Any:
        self.skip()
        if self.peek("{"):
            self.i += 1
            obj: dict[str, Any] = {}

            def member() -> None:
                k = self.key()
                self.expect(":")
                obj[k] = self.value()

            self.items("}", member)
            return obj
        if self.peek("["):
            self.i += 1
            arr: list[Any] = []
            self.items("]", lambda: arr.append(self.value()))
            return arr
        if self.peek(QUOTE):
            return self.string()
        m = _NUMBER.match(self.text, self.i)
        if m is not None:
            self.i = m.end()
            return json.loads(m.group())
        m = _WORD.match(self.text, self.i)
        if m is not None and m.group() in _LITERALS:
            self.i = m.end()
            return _LITERALS[m.group()]
        raise ValueError(f"unreadable value at {self.i} in {self.text!r}")


def read_value(text: str) -> Any:
    """The one value ``text`` holds; a ``ValueError`` if it holds anything more or less."""
    r = _Reader(text)
    v = r.value()
    r.skip()
    if r.i != len(text):
        raise ValueError(f"text after the value at {r.i} in {text!r}")
    return v


def write_value(v: Any) -> str:
    """The inverse of ``read_value``, for tests and for rendering tool results."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{write_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(write_value(x) for x in v) + "]"
    if isinstance(v, str):
        return QUOTE + v + QUOTE
    return json.dumps(v)
