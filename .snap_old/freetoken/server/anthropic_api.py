"""The Anthropic Messages API: ``/v1/messages`` (streamed or not) and
``/v1/messages/count_tokens``.

A stream follows Anthropic's event order: ``message_start``, ``ping``, then per content block
``content_block_start`` / ``content_block_delta``... / ``content_block_stop`` with indices from
0, then ``message_delta`` (stop reason, usage) and ``message_stop``; a request that cannot
finish ends with an ``error`` event instead. ``message_start`` goes out as soon as the request
is accepted, before the engine has scheduled it: its usage counts the whole prompt as
``input_tokens`` (the share read from the prefix cache is known only once the prompt is
scheduled); ``message_delta``'s usage carries the final figures, which are cumulative and
replace the start's (``input_tokens`` + ``cache_read_input_tokens`` is the prompt in both).
Thinking blocks are signed (``signing.py``) and a client's must come back with their
signatures; ``thinking.budget_tokens`` caps the reasoning, after which the family's thought
closer is forced and the answer follows (``thought_budget.py``).
``tool_choice`` ``any`` or ``tool`` forces a call: the prompt ends with the family's tool-call
opener (``render.forced``). An output whose tool call did not parse stops
with ``"malformed_tool_call"``, its text in a ``text`` block (see ``output.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from freetoken.engine.sample import SamplingParams
from freetoken.server.anthropic_protocol import CountTokensRequest, MessagesRequest, tool_input
from freetoken.server.errors import error_body
from freetoken.server.generate import (
    Outcome,
    admit,
    check_model,
    ended_early,
    generate,
    token_budget,
)
from freetoken.server.output import MALFORMED, gathered, output_parser, parsed
from freetoken.server.parsers import ContentDelta, Event, ReasoningDelta, ToolCall, merge_deltas
from freetoken.server.render import Prompt, forced, render, tokenized
from freetoken.server.signing import ThinkingSigner
from freetoken.server.state import GONE, ServerState
from freetoken.server.stream import sse
from freetoken.server.thought_budget import ThoughtBudget


def anthropic_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    def prompt_of(req: CountTokensRequest) -> Prompt:
        req.unserved()
        check_model(state, req.model)
        messages = req.conversation(state.signer)
        prompt = render(state, messages, req.template_tools(),
                        prefill=messages[-1]["role"] == "assistant",
                        enable_thinking=req.thinking_on())
        return forced(state, prompt, req.forced_call())

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, int]:
        return {"input_tokens": len(prompt_of(req).ids)}

    @router.post("/v1/messages", response_model=None)
    async def messages(req: MessagesRequest, request: Request) -> Any:
        prompt = prompt_of(req)
        max_tokens = token_budget(state, prompt.ids, req.max_tokens)
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                max_tokens=max_tokens)
        admit(state)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        parser = output_parser(state, prompt, tools=req.template_tools() is not None)
        stops = req.stop_sequences or []
        cap = req.thinking_budget()
        budget = None if cap is None else \
            ThoughtBudget(cap, parser, lambda text: tokenized(state, text).ids)
        if req.stream:
            events = parsed(generate(state, mid, prompt.ids, params, stops, budget=budget,
                                     keep_special=parser.special_tokens), parser)
            return StreamingResponse(message_stream(mid, len(prompt.ids), events),
                                     media_type="text/event-stream")
        evs, out = await gathered(parsed(
            generate(state, mid, prompt.ids, params, stops, watch=request, budget=budget,
                     keep_special=parser.special_tokens), parser))
        if out.finish_reason == GONE:
            return Response(status_code=499)
        if err := ended_early(out):
            raise err
        content = [block(e, state.signer) for e in merge_deltas(evs)]
        return {**message_head(mid, state.model_name), "content": content,
                "stop_reason": stop_reason(out, any(isinstance(e, ToolCall) for e in evs)),
                "stop_sequence": out.stop_sequence, "usage": usage(out)}

    async def message_stream(mid: str, prompt_tokens: int,
                             events: AsyncIterator[tuple[list[Event], Outcome]],
                             ) -> AsyncIterator[str]:
        stream = MessageEvents(mid, state.model_name, state.signer)
        try:
            for chunk in stream.start(prompt_tokens):
                yield chunk
            async for evs, out in events:
                for chunk in stream.step(evs, out):
                    yield chunk
                if stream.ended:
                    return
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    return router


class MessageEvents:
    """The stream events of one message, one generation step at a time (no I/O here)."""

    def __init__(self, mid: str, model: str, signer: ThinkingSigner) -> None:
        self.mid, self.model = mid, model
        self.blocks = Blocks(signer)
        self.ended = False

    def start(self, prompt_tokens: int) -> Iterator[str]:
        """``message_start`` and a ``ping``, before any token: the whole prompt counted as
        input, since how much of it the prefix cache holds is not known yet."""
        yield event("message_start", {"message": {
            **message_head(self.mid, self.model), "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": usage(Outcome(prompt_tokens=prompt_tokens))}})
        yield event("ping", {})

    def step(self, evs: list[Event], out: Outcome) -> Iterator[str]:
        if err := ended_early(out):
            self.ended = True
            yield event("error", error_body("anthropic", err.status, err.message))
            return
        for e in evs:
            yield from self.blocks.push(e)
        if out.finish_reason:
            self.ended = True
            yield from self.blocks.close()
            yield event("message_delta", {
                "delta": {"stop_reason": stop_reason(out, self.blocks.called),
                          "stop_sequence": out.stop_sequence}, "usage": usage(out)})
            yield event("message_stop", {})


class Blocks:
    """Parser events as content-block stream events: a text or thinking block stays open while
    its kind of text continues; a tool call is one whole ``tool_use`` block. A thinking block
    gets its signature in a ``signature_delta`` just before its ``content_block_stop``."""

    def __init__(self, signer: ThinkingSigner) -> None:
        self.signer = signer
        self.index = -1
        self.open: str | None = None  # the kind of the open block
        self.thinking = ""  # the open thinking block's text so far
        self.called = False

    def push(self, e: Event) -> Iterator[str]:
        if isinstance(e, ToolCall):
            yield from self.close()
            self.index, self.called = self.index + 1, True
            yield event("content_block_start", {"index": self.index, "content_block": {
                "type": "tool_use", "id": e.id, "name": e.name, "input": {}}})
            yield event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": e.arguments}})
            yield from self.close(force=True)
            return
        kind = "thinking" if isinstance(e, ReasoningDelta) else "text"
        if kind != self.open:
            yield from self.close()
            self.index, self.open = self.index + 1, kind
            start = {"type": "thinking", "thinking": "", "signature": ""} \
                if kind == "thinking" else {"type": "text", "text": ""}
            yield event("content_block_start", {"index": self.index, "content_block": start})
        if kind == "thinking":
            self.thinking += e.text
        yield event("content_block_delta", {"index": self.index, "delta": {
            "type": f"{kind}_delta", kind: e.text}})

    def close(self, force: bool = False) -> Iterator[str]:
        if self.open == "thinking":
            yield event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": self.signer.sign(self.thinking)}})
            self.thinking = ""
        if self.open or force:
            yield event("content_block_stop", {"index": self.index})
            self.open = None


def message_head(mid: str, model: str) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model}


def block(e: Event, signer: ThinkingSigner) -> dict[str, Any]:
    if isinstance(e, ToolCall):
        return {"type": "tool_use", "id": e.id, "name": e.name, "input": tool_input(e.arguments)}
    if isinstance(e, ReasoningDelta):
        return {"type": "thinking", "thinking": e.text, "signature": signer.sign(e.text)}
    assert isinstance(e, ContentDelta)
    return {"type": "text", "text": e.text}


def stop_reason(out: Outcome, called: bool) -> str | None:
    if out.finish_reason == "length":
        return "max_tokens"
    if out.stop_sequence is not None:
        return "stop_sequence"
    if out.malformed_tool_call:
        return MALFORMED
    return "tool_use" if called else "end_turn"


def usage(out: Outcome) -> dict[str, int]:
    """Anthropic counts cache reads apart: ``input_tokens`` are the prompt tokens computed."""
    return {"input_tokens": out.prompt_tokens - out.cached_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": out.completion_tokens}


def event(kind: str, body: dict[str, Any]) -> str:
    return sse({"type": kind, **body}, event=kind)
