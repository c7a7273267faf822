"""The OpenAI-compatible HTTP API (FastAPI). Tokenising and detokenising happen here, so the
engine process only ever sees token ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from freetoken.engine.detok import Detokenizer
from freetoken.engine.sample import SamplingParams
from freetoken.engine.scheduler import Event
from freetoken.server.errors import APIError, error_response
from freetoken.server.metrics import Metrics
from freetoken.server.process import EngineClient
from freetoken.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from freetoken.server.stacks import thread_stacks
from freetoken.server.stream import StopMatcher, sse

DEFAULT_MAX_TOKENS = 1024


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    model_name: str
    max_len: int
    chat_template: str | None
    max_queued: int
    metrics: Metrics = field(default_factory=Metrics)
    started: float = field(default_factory=time.time)


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="FreeToken", docs_url=None, redoc_url=None)
    m = state.metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.kind)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", ""
        return error_response(400, f"{loc}: {msg}" if loc else msg, loc or None)

    @app.middleware("http")
    async def count(request: Request, call_next: Any) -> Response:
        response = await call_next(request)
        m.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.client.dead:
            return error_response(503, f"engine failed: {state.client.dead}", kind="server_error")
        watch = state.client.stats.get("watchdog") or {}
        if watch.get("stuck"):  # the engine lives but makes no progress: say where it is
            return JSONResponse({"status": "stuck", "watchdog": watch}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.started),
            "owned_by": "freetoken", "max_model_len": state.max_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        m.engine_stats(state.client.stats)
        return Response(generate_latest(m.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/stats")
    async def stats() -> dict[str, Any]:
        return {"model": state.model_name, "engine": state.client.stats,
                "in_flight": len(state.client.queues), "engine_info": state.client.info}

    @app.get("/debug/stacks")
    async def stacks() -> dict[str, str]:
        """Every thread's Python stack of this process and of the engine process (which answers
        from a thread of its own, so a busy or stuck engine still does)."""
        engine = await asyncio.to_thread(state.client.engine_stacks)
        return {"api": thread_stacks("API process"), "engine": engine}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        if state.chat_template is None:
            raise APIError(400, f"model {state.model_name!r} has no chat template; start the "
                           "server with --chat-template FILE, or use /v1/completions")
        messages = [{"role": msg.role, "content": msg.text()} for msg in req.messages]
        try:
            text = state.tokenizer.apply_chat_template(
                messages, chat_template=state.chat_template, add_generation_prompt=True,
                tokenize=False)
        except Exception as e:  # a template may raise on roles it does not support
            raise APIError(400, f"the chat template rejected these messages: {e}",
                           "messages") from e
        ids = state.tokenizer(text, add_special_tokens=False).input_ids
        return await respond(req, list(ids), request, chat=True)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one "
                               "request per prompt", "prompt")
            p = p[0]
        if isinstance(p, str):
            ids = list(state.tokenizer(p).input_ids)
        else:
            ids = [int(t) for t in p]
            vocab = len(state.tokenizer)
            if any(t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return await respond(req, ids, request, chat=False)

    async def respond(req: SamplingFields, ids: list[int], request: Request, chat: bool) -> Any:
        params = sampling_params(req, ids)
        if state.client.dead:
            raise APIError(503, "the engine process has failed; restart the server",
                           kind="server_error")
        if len(state.client.queues) >= state.max_queued:
            raise APIError(503, f"server is at capacity ({state.max_queued} requests in "
                           "flight); retry later", kind="server_error")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        m.prompt_tokens.inc(len(ids))
        events = generate(rid, ids, params, req.stops())
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_body(rid, events, chat, request, include_usage),
                                     media_type="text/event-stream")
        out = Outcome()
        try:
            async for _, outcome in events:
                out = outcome
                if await request.is_disconnected():
                    break
        finally:
            await events.aclose()
        if out.finish_reason == "error":
            raise APIError(400, out.text or "the request could not be served")
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice |= {"text": out.text, "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": state.model_name, "choices": [choice],
                "usage": out.usage()}

    def sampling_params(req: SamplingFields, ids: list[int]) -> SamplingParams:
        if req.model is not None and req.model != state.model_name:
            raise APIError(404, f"model {req.model!r} not found (this server serves "
                           f"{state.model_name!r})", "model", "not_found_error")
        if req.n != 1:
            raise APIError(400, "n > 1 is not supported; send n requests", "n")
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        room = state.max_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context holds "
                           f"{state.max_len}; shorten it", "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} + prompt {len(ids)} tokens exceeds the "
                           f"context of {state.max_len}", "max_tokens")
        vocab = len(state.tokenizer)
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            max_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, room), seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop_token_ids=tuple(t for t in (req.stop_token_ids or []) if 0 <= t < vocab),
            ignore_eos=req.ignore_eos)

    async def generate(rid: str, ids: list[int], params: SamplingParams,
                       stops: list[str]) -> AsyncIterator[tuple[str, Outcome]]:
        """Text deltas of one request with its running outcome; aborts the engine side on exit."""
        queue = state.client.submit(rid, ids, params)
        detok, matcher, out = Detokenizer(state.tokenizer), StopMatcher(stops), Outcome()
        t0 = last = time.monotonic()
        try:
            while out.finish_reason is None:
                e: Event = await queue.get()
                now = time.monotonic()
                if e.finish_reason == "error":
                    out.text, out.finish_reason = e.error or "engine error", "error"
                    break
                out.prompt_tokens, out.cached_tokens = e.prompt_tokens, e.cached_tokens
                out.completion_tokens = e.completion_tokens
                delta, hit = "", False
                if e.token is not None:
                    m.generation_tokens.inc()
                    (m.ttft if out.completion_tokens == 1 else m.itl).observe(
                        now - (t0 if out.completion_tokens == 1 else last))
                    last = now
                    if e.finish_reason != "stop" or e.token not in params.stop_token_ids:
                        delta, hit = matcher.push(detok.push(e.token))
                if hit:
                    out.finish_reason = "stop"
                elif e.finish_reason:
                    out.finish_reason = e.finish_reason
                    delta += matcher.flush()
                out.text += delta
                yield delta, out
        finally:
            if out.finish_reason in (None, "stop"):
                state.client.abort(rid)  # stop string or client gone: free its KV now
            state.client.done(rid)

    async def stream_body(rid: str, events: AsyncIterator[tuple[str, Outcome]], chat: bool,
                          request: Request, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
                if delta:
                    d["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish,
                          "logprobs": None}
            return sse({"id": rid, "object": kind, "created": created,
                        "model": state.model_name, "choices": [choice]})

        out = Outcome()
        try:
            if chat:
                yield chunk(None, None, first=True)
            async for delta, out in events:
                if out.finish_reason == "error":
                    yield sse({"error": {"message": out.text, "type": "invalid_request_error",
                                         "code": 400}})
                    return
                if delta or out.finish_reason:
                    yield chunk(delta, out.finish_reason)
            if include_usage:
                yield sse({"id": rid, "object": kind, "created": created,
                           "model": state.model_name, "choices": [], "usage": out.usage()})
            yield sse("[DONE]")
        finally:
            await events.aclose()

    return app
