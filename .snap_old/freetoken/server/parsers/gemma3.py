"""Gemma 3: no tool tokens; tool calls are Python calls in a ```` ```tool_code ```` block.

Gemma 3 was trained to call functions through the prompt alone: the prompt describes the
functions and asks for calls in a fenced block, e.g. ```` ```tool_code\\nget_weather(city=
"Paris")\\n``` ````, one call per line or a list of calls. Only keyword arguments with literal
values are a call we can send as JSON; anything else is returned as text. There is no
reasoning markup.
"""

from __future__ import annotations

import ast
import json

from .base import OutputParser
from .events import ContentDelta
from .scan import BodyScanner

CALL, END_CALL = "```tool_code", "```"
ENDS = ("<end_of_turn>", "<eos>")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def read_calls(body: str) -> list[tuple[str, str]] | None:
    """Every call in a ``tool_code`` block as ``(name, arguments JSON)``; None if any is not a
    call with literal keyword arguments (the block is then text, not a partial set of calls)."""
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except SyntaxError:
        return None
    nodes: list[ast.expr] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        v = stmt.value
        nodes.extend(v.elts if isinstance(v, ast.List | ast.Tuple) else [v])
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None or any(k.arg is None for k in node.keywords):
            return None
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError):
            return None
    return calls or None


class Gemma3Parser(OutputParser):
    name = "gemma3"
    anchor = "<start_of_turn>model\n"

    in_call = False

    def _step(self, final: bool) -> None:
        while True:
            if self.in_call:
                if not self._call_step(final):
                    return
                continue
            marker = self._plain_step(ContentDelta, (CALL, *ENDS), final)
            if marker is None:
                return
            if marker == CALL:
                self.in_call = True
                self.scanner = BodyScanner((END_CALL,), ('"', "'"), "\\")
            else:
                self._begin(ContentDelta)

    def call_opener(self, name: str | None) -> str | None:
        """A ``tool_code`` block, then for a named tool the start of its Python call."""
        return CALL + "\n" + ("" if name is None else name + "(")

    def _call_step(self, final: bool) -> bool:
        closer = self._close_call(CALL, read_calls, final)
        if closer is None:
            return False
        self.in_call = False
        self._begin(ContentDelta)
        return closer != ""
