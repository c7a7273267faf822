"""The OpenAI API: ``/v1/chat/completions`` and ``/v1/completions``, streamed or not.

A chat output whose tool call did not parse finishes with ``"malformed_tool_call"``, its text
in ``content`` (see ``output.py``). ``tool_choice`` ``"required"`` or a named function forces a
call: the prompt ends with the family's tool-call opener (``render.forced``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from freetoken.engine.sample import SamplingParams, TokenLogprobs
from freetoken.server.errors import APIError, error_body
from freetoken.server.generate import (
    Outcome,
    admit,
    check_model,
    disconnected,
    ended_early,
    generate,
    run,
    token_budget,
    usage_openai,
    valid_stop_ids,
)
from freetoken.server.output import MALFORMED, gathered, output_parser, parsed
from freetoken.server.parsers import ContentDelta, Event, ReasoningDelta, ToolCall
from freetoken.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from freetoken.server.render import forced, render
from freetoken.server.state import GONE, ServerState
from freetoken.server.stream import sse


def openai_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        req.unserved()
        check_model(state, req.model)
        messages = [m.for_template(i) for i, m in enumerate(req.messages)]
        tools = req.template_tools()
        prompt = forced(state, render(state, messages, tools, **(req.chat_template_kwargs or {})),
                        req.forced_call())
        params = sampling_params(state, req, prompt.ids)
        admit(state)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        lps = None if params.logprobs is None else (lambda e: chat_logprobs(state, e))

        def events(i: int, watch: Request | None = None) -> ParsedSteps:
            parser = output_parser(state, prompt, tools=bool(tools))
            return parsed(generate(state, choice_id(rid, i), prompt.ids, choice_params(params, i),
                                   req.stops(), watch=watch,
                                   keep_special=parser.special_tokens), parser)

        if req.stream:
            return StreamingResponse(
                chat_stream(rid, [events(i) for i in range(req.n)], _include_usage(req), lps),
                media_type="text/event-stream")
        done = await every_choice(req.n, request, lambda i, w: gathered(events(i, w)))
        if done is None or any(out.finish_reason == GONE for _, out in done):
            return Response(status_code=499)  # nobody is listening
        for _, out in done:
            if err := ended_early(out):
                raise err
        choices = []
        for i, (evs, out) in enumerate(done):
            message = chat_message(evs)
            choices.append({"index": i, "message": message,
                            "logprobs": lps and lps(out.logprobs),
                            "finish_reason": finish_reason(out, "tool_calls" in message)})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": state.model_name, "usage": usage_of([o for _, o in done]),
                "choices": choices}

    @router.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        req.unserved()
        check_model(state, req.model)
        ids = prompt_ids(state, req.prompt)
        params = sampling_params(state, req, ids, prompt_field="prompt")
        admit(state)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        asked = params.logprobs is not None

        def steps(i: int, watch: Request | None = None) -> AsyncIterator[tuple[str, Outcome]]:
            return generate(state, choice_id(rid, i), ids, choice_params(params, i),
                            req.stops(), watch=watch)

        if req.stream:
            return StreamingResponse(
                completion_stream(rid, [steps(i) for i in range(req.n)], _include_usage(req),
                                  asked),
                media_type="text/event-stream")
        outs = await every_choice(req.n, request, lambda i, w: run(steps(i, w)))
        if outs is None or any(out.finish_reason == GONE for out in outs):
            return Response(status_code=499)
        for out in outs:
            if err := ended_early(out):
                raise err
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": state.model_name, "usage": usage_of(outs),
                "choices": [{"index": i, "text": out.text, "logprobs":
                             completion_logprobs(state, out.logprobs) if asked else None,
                             "finish_reason": out.finish_reason} for i, out in enumerate(outs)]}

    async def chat_stream(rid: str, choices: list[ParsedSteps], include_usage: bool,
                          logprobs: Logprobs | None) -> AsyncIterator[str]:
        chunks = [ChatChunks(rid, state.model_name, logprobs, i) for i in range(len(choices))]
        outs = [Outcome() for _ in choices]

        async def one(i: int) -> AsyncIterator[str]:
            async for evs, out in choices[i]:
                outs[i] = out
                for chunk in chunks[i].step(evs, out):
                    yield chunk
                if chunks[i].failed:
                    return

        stream = merged([one(i) for i in range(len(choices))])
        try:
            for c in chunks:
                yield c.first()
            async for chunk in stream:
                yield chunk
            if any(c.failed for c in chunks):
                return
            if include_usage:
                yield chunks[0].usage(outs)
            yield sse("[DONE]")
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            for steps in choices:
                await steps.aclose()  # type: ignore[attr-defined]

    async def completion_stream(rid: str, choices: list[AsyncIterator[tuple[str, Outcome]]],
                                include_usage: bool, asked: bool) -> AsyncIterator[str]:
        created = int(time.time())
        outs = [Outcome() for _ in choices]
        failed = False

        def chunk(choices_: list[dict[str, Any]], **extra: Any) -> str:
            return sse({"id": rid, "object": "text_completion", "created": created,
                        "model": state.model_name, "choices": choices_, **extra})

        async def one(i: int) -> AsyncIterator[str]:
            nonlocal failed
            sent = shown = 0  # tokens whose logprobs went out; characters of text before them
            async for delta, out in choices[i]:
                outs[i] = out
                if err := ended_early(out):
                    failed = True
                    yield sse(error_body("openai", err.status, err.message))
                    return
                if delta or out.finish_reason:
                    lps = None
                    if asked:
                        lps = completion_logprobs(state, out.logprobs[sent:], shown)
                        sent, shown = len(out.logprobs), shown + len(delta)
                    yield chunk([{"index": i, "text": delta, "logprobs": lps,
                                  "finish_reason": out.finish_reason}])

        stream = merged([one(i) for i in range(len(choices))])
        try:
            async for item in stream:
                yield item
            if failed:
                return
            if include_usage:
                yield chunk([], usage=usage_of(outs))
            yield sse("[DONE]")
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            for steps in choices:
                await steps.aclose()  # type: ignore[attr-defined]

    return router


class ChatChunks:
    """The ``chat.completion.chunk`` events of one completion, one generation step at a time
    (no I/O here)."""

    def __init__(self, rid: str, model: str, logprobs: Logprobs | None = None,
                 index: int = 0) -> None:
        self.rid, self.model, self.created, self.index = rid, model, int(time.time()), index
        self.called = self.failed = False
        self.logprobs, self.sent = logprobs, 0  # the formatter; tokens whose logprobs went out
        self.pending: list[tuple[int, TokenLogprobs]] = []

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        lps = None
        if self.logprobs is not None and delta.get("role") is None:
            lps, self.pending = self.logprobs(self.pending), []
        return sse(self._head() | {"choices": [{"index": self.index, "delta": delta,
                                                "logprobs": lps, "finish_reason": finish}]})

    def first(self) -> str:
        return self.chunk({"role": "assistant", "content": ""})

    def step(self, evs: list[Event], out: Outcome) -> Iterator[str]:
        if err := ended_early(out):
            self.failed = True
            yield sse(error_body("openai", err.status, err.message))
            return
        self.pending += out.logprobs[self.sent:]
        self.sent = len(out.logprobs)
        for e in evs:
            self.called |= isinstance(e, ToolCall)
            yield self.chunk(chat_delta(e))
        if out.finish_reason:
            yield self.chunk({}, finish_reason(out, self.called))

    def usage(self, outs: list[Outcome]) -> str:
        return sse(self._head() | {"choices": [], "usage": usage_of(outs)})

    def _head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model}


def sampling_params(state: ServerState, req: SamplingFields, ids: list[int],
                    prompt_field: str = "messages") -> SamplingParams:
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_tokens = token_budget(state, ids, req.max_completion_tokens or req.max_tokens, field,
                              prompt_field)
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        max_tokens=max_tokens, seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        stop_token_ids=valid_stop_ids(state, req.stop_token_ids), ignore_eos=req.ignore_eos,
        logprobs=req.logprob_count())


Logprobs = Callable[[list[tuple[int, TokenLogprobs]]], dict[str, Any]]
ParsedSteps = AsyncIterator[tuple[list[Event], Outcome]]
T = TypeVar("T")


def choice_id(rid: str, i: int) -> str:
    """The engine's id of choice ``i`` of a request (choice 0 keeps the request's)."""
    return rid if i == 0 else f"{rid}-{i}"


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice ``i``'s sampling: a seeded request's choices draw with seeds seed, seed + 1, ..."""
    return params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)


async def every_choice(n: int, request: Request,
                       run_one: Callable[[int, Request | None], Awaitable[T]]) -> list[T] | None:
    """``run_one(i, watch)`` for the n choices of a request, at once. One choice watches the
    client itself; with several, one watcher for all of them cancels every choice (freeing
    their KV) when the client goes, and the result is None."""
    if n == 1:
        return [await run_one(0, request)]
    every = asyncio.gather(*(run_one(i, None) for i in range(n)))
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({every, gone}, return_when=asyncio.FIRST_COMPLETED)
        return every.result() if every.done() else None
    finally:
        gone.cancel()
        every.cancel()
        await asyncio.gather(every, gone, return_exceptions=True)  # retrieved: nothing logged


async def merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of several streams as they come (one stream: itself); closing this stops
    them all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
    finally:  # the streams end (their requests aborted) before this returns
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage_of(outs: list[Outcome]) -> dict[str, Any]:
    """A request's usage over its choices: the prompt once, every choice's completion."""
    return usage_openai(replace(outs[0], completion_tokens=sum(o.completion_tokens
                                                               for o in outs)))


def _token(state: ServerState, token: int) -> tuple[str, list[int]]:
    text = state.tokenizer.decode([token])
    return text, list(text.encode())


def chat_logprobs(state: ServerState, entries: list[tuple[int, TokenLogprobs]]
                  ) -> dict[str, Any]:
    """Chat's ``logprobs``: per token its text, log-probability, UTF-8 bytes and the top ones."""

    def entry(token: int, lp: float) -> dict[str, Any]:
        text, raw = _token(state, token)
        return {"token": text, "logprob": lp, "bytes": raw}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(i, v) for i, v in top]}
                        for t, (lp, top) in entries]}


def completion_logprobs(state: ServerState, entries: list[tuple[int, TokenLogprobs]],
                        offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs``: tokens, their log-probabilities, the top ones as
    text -> log-probability, and where each token's text starts (``offset``: the first's)."""
    tokens, starts = [], []
    for t, _ in entries:
        tokens.append(_token(state, t)[0])
        starts.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
            "top_logprobs": [{_token(state, i)[0]: v for i, v in top} for _, (_, top) in entries],
            "text_offset": starts}


def prompt_ids(state: ServerState, p: str | list[int] | list[str]) -> list[int]:
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, "a list of several prompts is not supported; send one request "
                           "per prompt", "prompt")
        p = p[0]
    if isinstance(p, str):
        return list(state.tokenizer(p).input_ids)
    ids = [int(t) for t in p]
    vocab = len(state.tokenizer)
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


def chat_delta(e: Event) -> dict[str, Any]:
    if isinstance(e, ContentDelta):
        return {"content": e.text}
    if isinstance(e, ReasoningDelta):
        return {"reasoning_content": e.text}
    return {"tool_calls": [{"index": e.index, **_tool_call(e)}]}


def chat_message(evs: list[Event]) -> dict[str, Any]:
    content = "".join(e.text for e in evs if isinstance(e, ContentDelta))
    calls = [_tool_call(e) for e in evs if isinstance(e, ToolCall)]
    reasoning = "".join(e.text for e in evs if isinstance(e, ReasoningDelta))
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def finish_reason(out: Outcome, called: bool) -> str | None:
    if out.finish_reason == "stop" and out.stop_sequence is None and out.malformed_tool_call:
        return MALFORMED
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


def _tool_call(e: ToolCall) -> dict[str, Any]:
    return {"id": e.id, "type": "function",
            "function": {"name": e.name, "arguments": e.arguments}}


def _include_usage(req: SamplingFields) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))
