"""Where generated text becomes reasoning, answer and tool calls, for both APIs.

Every chat (``/v1/chat/completions``) and messages (``/v1/messages``) output goes through
``output_parser``: the family's parser from ``server/parsers`` (``ServerState.parser_family``),
primed with the rendered prompt. ``parsed`` runs a generation through it, streaming or not,
so both APIs and both modes split text the same way; each API only shapes the events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from freetoken.server.generate import Outcome
from freetoken.server.parsers import Event, OutputParser, make_parser
from freetoken.server.render import Prompt
from freetoken.server.state import ServerState


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
