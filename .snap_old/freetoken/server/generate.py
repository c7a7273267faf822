"""The request core both APIs share: admission, token limits, and one generation as text.

``generate`` submits a prompt's ids and yields ``(delta, outcome)`` as tokens arrive:
detokenised, cut at the first stop string, with the usage so far. It ends at the engine's
finish, at a stop string, when the client goes away (``watch=request`` for a non-streaming
request; a streaming response notices on its own and closes the generator), or at the end of
the shutdown grace period (``ServerState.end_all``). Whenever it ends before the engine
finished, the engine side is aborted so its KV is freed at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from freetoken.engine.detok import Detokenizer
from freetoken.engine.sample import SamplingParams, TokenLogprobs
from freetoken.engine.scheduler import Event
from freetoken.server.errors import APIError
from freetoken.server.state import GONE, SHUTDOWN, ServerState
from freetoken.server.stream import StopMatcher
from freetoken.server.thought_budget import ThoughtBudget

DEFAULT_MAX_TOKENS = 1024


@dataclass
class Outcome:
    """A generation so far. ``finish_reason``: None while running, then the engine's ("stop",
    "length", "error") or the API process's (``GONE``, ``SHUTDOWN``); a stop string finishes
    with "stop" and names itself in ``stop_sequence``. ``malformed_tool_call``: the output
    parser found a tool call it could not parse (set by ``output.parsed`` at the finish)."""

    text: str = ""
    finish_reason: str | None = None
    stop_sequence: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    malformed_tool_call: bool = False
    # with logprobs asked for: (token id, its log-probability and the top ones) per output
    # token, the token that ends the turn (EOS, a stop token id) left out
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every output token, forced ones too


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} not found (this server serves "
                       f"{state.model_name!r})", "model")


def admit(state: ServerState) -> None:
    """Refuse a new request when the server cannot take it (503, retry later)."""
    if state.draining:
        raise APIError(503, "the server is shutting down; send the request to another server "
                       "or retry once it is back")
    if state.client.dead:
        raise APIError(503, "the engine process has failed; restart the server")
    if len(state.client.queues) >= state.max_queued:
        raise APIError(503, f"server is at capacity ({state.max_queued} requests in flight); "
                       "retry later")


def token_budget(state: ServerState, ids: list[int], requested: int | None,
                 field: str = "max_tokens", prompt_field: str = "messages") -> int:
    """How many tokens to generate at most: ``requested`` when prompt + it fit the context,
    else a 400 naming ``field``; unset, what fits up to ``DEFAULT_MAX_TOKENS``."""
    if not ids:
        raise APIError(400, "the prompt is empty", prompt_field)
    room = state.max_len - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids)} tokens but the context holds "
                       f"{state.max_len}; shorten it", prompt_field)
    if requested is not None and requested > room:
        raise APIError(400, f"{field} {requested} + prompt {len(ids)} tokens exceeds the "
                       f"context of {state.max_len}; ask for at most {room}", field)
    return requested or min(DEFAULT_MAX_TOKENS, room)


def valid_stop_ids(state: ServerState, ids: list[int] | None) -> tuple[int, ...]:
    vocab = len(state.tokenizer)
    return tuple(t for t in (ids or []) if 0 <= t < vocab)


async def generate(state: ServerState, rid: str, ids: list[int], params: SamplingParams,
                   stops: list[str], watch: Request | None = None, keep_special: bool = False,
                   budget: ThoughtBudget | None = None,
                   ) -> AsyncIterator[tuple[str, Outcome]]:
    """Text deltas of one request with its running outcome (see the module docstring).
    ``keep_special``: special tokens stay in the text (for a parser whose markers they are),
    but end-of-turn tokens (``ServerState.end_token_ids``) still never become text.
    ``budget``: a cap on the reasoning; the consumer must feed each delta to the budget's
    parser before asking for the next. When it is spent the engine request is aborted and a
    new one continues from the prompt, the tokens so far and the forced thought closer (its
    tokens count as output; the prefix cache holds what came before)."""
    m = state.metrics
    m.prompt_tokens.inc(len(ids))
    lane = _Lane(rid, state.client.submit(rid, ids, params))
    watcher = asyncio.ensure_future(_watch(watch, lane)) if watch is not None else None
    detok = Detokenizer(state.tokenizer, keep_special=keep_special,
                        hidden=state.end_token_ids if keep_special else ())
    matcher, out = StopMatcher(stops), Outcome()
    engine_done = False
    base = 0  # output tokens before the current engine request (a closed thought's)
    t0 = last = time.monotonic()
    try:
        while out.finish_reason is None:
            e: Event = await lane.queue.get()
            if e.finish_reason in (GONE, SHUTDOWN):
                out.finish_reason = e.finish_reason
                yield "", out
                break
            engine_done = e.finish_reason is not None
            if e.finish_reason == "error":
                out.error, out.finish_reason = e.error or "engine error", "error"
                yield "", out
                break
            if base == 0:
                out.prompt_tokens, out.cached_tokens = e.prompt_tokens, e.cached_tokens
            out.completion_tokens = base + e.completion_tokens
            delta, hit = "", False
            if e.token is not None:
                now = time.monotonic()
                m.generation_tokens.inc()
                first = out.completion_tokens == 1
                (m.ttft if first else m.itl).observe(now - (t0 if first else last))
                last = now
                out.token_ids.append(e.token)
                ends = e.finish_reason == "stop" and (e.token in params.stop_token_ids
                                                      or e.token in state.end_token_ids)
                if e.logprobs is not None and not ends:
                    out.logprobs.append((e.token, e.logprobs))
                if e.finish_reason != "stop" or e.token not in params.stop_token_ids:
                    delta, hit = matcher.push(detok.push(e.token))
            if hit:
                out.finish_reason, out.stop_sequence = "stop", matcher.matched
            elif e.finish_reason:
                out.finish_reason = e.finish_reason
                delta += matcher.flush()
            out.text += delta
            yield delta, out
            closer = budget.after_token() if budget and e.token is not None else None
            if closer and out.finish_reason is None:
                state.client.abort(lane.rid)
                closer = closer[:params.max_tokens - out.completion_tokens]  # max_tokens holds
                delta, hit = "", False
                for t in closer:
                    out.token_ids.append(t)
                    out.completion_tokens += 1
                    piece, hit = matcher.push(detok.push(t))
                    delta += piece
                    if hit:
                        break
                base = out.completion_tokens
                room = params.max_tokens - out.completion_tokens
                if hit:
                    out.finish_reason, out.stop_sequence = "stop", matcher.matched
                elif room < 1:
                    out.finish_reason = "length"
                    delta += matcher.flush()
                else:
                    lane.rid = f"{rid}+answer"
                    lane.queue = state.client.submit(lane.rid, ids + out.token_ids,
                                                     replace(params, max_tokens=room))
                out.text += delta
                yield delta, out
    finally:
        if watcher is not None:
            watcher.cancel()
        if engine_done:
            state.client.done(lane.rid)
        else:  # a stop string, a client gone, shutdown: free its KV now
            state.client.abort(lane.rid)


@dataclass
class _Lane:
    """The engine request a generation reads now (a thought budget starts a second one)."""

    rid: str
    queue: asyncio.Queue[Event]


async def disconnected(request: Request) -> None:
    """Return when the client has disconnected (blocked in the server's receive meanwhile)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watch(request: Request, lane: _Lane) -> None:
    """End the request through its own queue once the client disconnects."""
    await disconnected(request)
    lane.queue.put_nowait(Event(lane.rid, None, GONE, 0, 0, 0))


async def run(events: AsyncIterator[tuple[str, Outcome]]) -> Outcome:
    """Drive a generation to its end; the final outcome."""
    out = Outcome()
    async for _, step in events:
        out = step
    return out


def usage_openai(out: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def ended_early(out: Outcome) -> APIError | None:
    """The error a request gets when its generation did not finish: the engine refused or
    failed it (400 / 503), or the server stopped it at shutdown (503)."""
    if out.finish_reason == "error":
        failed = "engine process failed" in (out.error or "")
        return APIError(503 if failed else 400, out.error or "the request could not be served")
    if out.finish_reason == SHUTDOWN:
        return APIError(503, f"the server shut down before the request finished (after "
                        f"{out.completion_tokens} tokens); retry it")
    return None
