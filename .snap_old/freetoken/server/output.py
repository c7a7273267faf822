"""Where generated text becomes reasoning, answer and tool calls, for both APIs.

Every chat (``/v1/chat/completions``) and messages (``/v1/messages``) output goes through
``output_parser``: the family's parser from ``server/parsers`` (``ServerState.parser_family``),
primed with the rendered prompt. ``parsed`` runs a generation through it, streaming or not,
so both APIs and both modes split text the same way; each API only shapes the events.
A family whose markers are special tokens (``OutputParser.special_tokens``: harmony, Gemma-4)
gets its output decoded with them kept (``generate(keep_special=...)``), end-of-turn tokens
dropped; ``/v1/completions`` and the other families see text with special tokens skipped.

A tool call that does not parse is never an error. Its raw text, markup included, comes back
as content (a ``text`` block), the calls that did parse are still returned, and the finish
says so with ``MALFORMED``: OpenAI ``finish_reason`` and Anthropic ``stop_reason``
``"malformed_tool_call"``, in place of ``"stop"`` / ``"tool_calls"`` and ``"end_turn"`` /
``"tool_use"``. It does so only when the model ended its turn itself: a call cut by
``max_tokens`` or a stop string keeps ``"length"`` / ``"max_tokens"`` or the stop's reason,
which is what cut it. A client that knows only the standard values may treat it as ``"stop"``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from freetoken.server.generate import Outcome
from freetoken.server.parsers import Event, OutputParser, make_parser
from freetoken.server.render import Prompt
from freetoken.server.state import ServerState

MALFORMED = "malformed_tool_call"  # the finish of an output with a tool call that did not parse


def output_parser(state: ServerState, prompt: Prompt, tools: bool) -> OutputParser:
    """A parser for one output of ``prompt``; ``tools``: the request offered tools (without,
    tool-call markup stays text)."""
    return make_parser(state.parser_family, prompt=prompt.text, tools=tools)


async def parsed(events: AsyncIterator[tuple[str, Outcome]], parser: OutputParser,
                 ) -> AsyncIterator[tuple[list[Event], Outcome]]:
    """The generation's text deltas as parser events, with the outcome so far; the step that
    finishes the generation carries what the parser held back."""
    try:
        async for delta, out in events:
            evs = parser.feed(delta) if delta else []
            if out.finish_reason is not None:
                evs += parser.finish()
                out.malformed_tool_call = parser.malformed_tool_call
            yield evs, out
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def gathered(steps: AsyncIterator[tuple[list[Event], Outcome]],
                   ) -> tuple[list[Event], Outcome]:
    """A parsed generation run to its end: all its events and the final outcome."""
    evs: list[Event] = []
    out = Outcome()
    async for step, now in steps:
        evs, out = evs + step, now
    return evs, out
