"""Reasoning, answer and tool calls out of a model's generated text, per model family.

``parser_family`` picks the family from the checkpoint's architecture (or a flag);
``make_parser`` gives a streaming ``OutputParser`` for one output: ``feed`` it detokenized
deltas, ``finish`` it at the end, and forward the ``ReasoningDelta``, ``ContentDelta`` and
``ToolCall`` events. ``parse_text`` does the same for a whole text. ``call_opener`` gives the
text that, appended to a prompt, makes the output the rest of a tool call (a forced
``tool_choice``). A tool call that does not parse is never an error: it comes back as content
and sets ``malformed_tool_call``.
"""

from __future__ import annotations

from .base import OutputParser, new_call_id
from .events import (
    ContentDelta,
    Event,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    collect,
    merge_deltas,
)
from .registry import (
    ARCHITECTURES,
    PARSERS,
    call_opener,
    make_parser,
    parse_text,
    parser_family,
    parser_names,
)

__all__ = [
    "ARCHITECTURES",
    "PARSERS",
    "ContentDelta",
    "Event",
    "OutputParser",
    "ParsedOutput",
    "ReasoningDelta",
    "ToolCall",
    "call_opener",
    "collect",
    "make_parser",
    "merge_deltas",
    "new_call_id",
    "parse_text",
    "parser_family",
    "parser_names",
]
