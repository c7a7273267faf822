"""Reasoning, text and tool calls out of a family's parser, shaped by each API's stream, read
back by the official clients' own stream accumulators (no server: the shaping is pure)."""

from __future__ import annotations

import json

import pytest
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from freetoken.server.anthropic_api import MessageEvents
from freetoken.server.generate import Outcome
from freetoken.server.openai_api import ChatChunks
from freetoken.server.parsers import make_parser
from freetoken.server.signing import ThinkingSigner
from freetoken.server.state import SHUTDOWN

SIGNER = ThinkingSigner()

CALL = {"city": "Paris", "days": 3}
TEXT = ("<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": CALL}) + "\n</tool_call>")


def steps(text: str, cut: int, finish: str = "stop") -> list[tuple[list, Outcome]]:
    """``text`` generated ``cut`` characters at a time through the Qwen3 parser."""
    parser = make_parser("qwen3", tools=True)
    out, done = [], Outcome(prompt_tokens=20, cached_tokens=4)
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    for n, piece in enumerate(pieces, 1):
        now = Outcome(prompt_tokens=20, cached_tokens=4, completion_tokens=n,
                      finish_reason=finish if n == len(pieces) else None)
        evs = parser.feed(piece) + (parser.finish() if now.finish_reason else [])
        out.append((evs, now))
        done = now
    assert done.finish_reason == finish
    return out


def sse_events(chunks: list[str]) -> list[tuple[str | None, dict]]:
    out = []
    for chunk in chunks:
        lines = dict(line.split(": ", 1) for line in chunk.strip().split("\n"))
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_anthropic_stream_accumulates_to_thinking_text_and_tool_use(cut):
    stream = MessageEvents("msg_1", "m", SIGNER)
    chunks = [*stream.start(20), *(c for evs, out in steps(TEXT, cut)
                                   for c in stream.step(evs, out))]
    events = sse_events(chunks)
    assert all(name == body["type"] for name, body in events)
    # the start counts the whole prompt as input; the delta splits off what the cache held
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 20, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0,
        "output_tokens": 0}
    assert events[-2][1]["usage"] == {
        "input_tokens": 16, "cache_read_input_tokens": 4, "cache_creation_input_tokens": 0,
        "output_tokens": len(steps(TEXT, cut))}
    snapshot, bufs = None, {}
    for _, body in events:
        event = construct_type(type_=RawMessageStreamEvent, value=body)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "The user wants the weather."
    assert SIGNER.valid(snapshot.content[0].thinking, snapshot.content[0].signature)
    assert snapshot.content[1].text == "Let me check."
    assert snapshot.content[2].name == "get_weather" and snapshot.content[2].input == CALL
    assert snapshot.stop_reason == "tool_use"
    assert snapshot.usage.input_tokens == 16 and snapshot.usage.cache_read_input_tokens == 4
    starts = [b["index"] for _, b in events if b["type"] == "content_block_start"]
    stops = [b["index"] for _, b in events if b["type"] == "content_block_stop"]
    assert starts == stops == [0, 1, 2]


@pytest.mark.parametrize("cut", [1, 5, 1000])
def test_openai_stream_accumulates_to_reasoning_content_and_tool_calls(cut):
    chunks = ChatChunks("chatcmpl-1", "m")
    state = ChatCompletionStreamState()
    raw = [chunks.first()] + [c for evs, out in steps(TEXT, cut) for c in chunks.step(evs, out)]
    for _, body in sse_events(raw):
        state.handle_chunk(ChatCompletionChunk.model_validate(body))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.reasoning_content == "The user wants the weather."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL


def test_a_stream_ended_at_shutdown_ends_with_an_error_event():
    stream = MessageEvents("msg_1", "m", SIGNER)
    [(evs, out)] = steps("Hello", 1000)
    first = [*stream.start(3), *stream.step(evs, Outcome(prompt_tokens=3, completion_tokens=1))]
    last = sse_events(list(stream.step([], Outcome(finish_reason=SHUTDOWN))))
    assert [n for n, _ in sse_events(first)][:2] == ["message_start", "ping"]
    assert last == [("error", {"type": "error", "error": {
        "type": "overloaded_error", "message": last[0][1]["error"]["message"]}})]
    assert "shut down" in last[0][1]["error"]["message"] and stream.ended
