"""What a parser emits: typed events while streaming, one ``ParsedOutput`` for a whole text."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningDelta:
    """More of the model's reasoning (``reasoning_content``, a thinking block)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More of the answer the user sees (``content``, a text block)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call. ``arguments`` is a JSON object as text, as the OpenAI API sends it;
    ``index`` counts the calls of one output from 0."""

    index: int
    id: str
    name: str
    arguments: str


Event = ReasoningDelta | ContentDelta | ToolCall


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output, split. ``malformed_tool_call`` is set when something that opened a tool call
    did not parse as one: its text is in ``content`` and the API layer says so in its finish
    reason rather than failing the request."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    malformed_tool_call: bool


def merge_deltas(events: Iterable[Event]) -> list[Event]:
    """Adjacent deltas of one kind joined into one, so that two streams that differ only in how
    their text was cut compare equal."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ReasoningDelta | ContentDelta) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)  # type: ignore[union-attr]
        else:
            out.append(e)
    return out


def collect(events: Iterable[Event], malformed_tool_call: bool) -> ParsedOutput:
    """The events of one output folded into its three parts."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for e in events:
        if isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        else:
            calls.append(e)
    return ParsedOutput("".join(content), "".join(reasoning), tuple(calls), malformed_tool_call)
