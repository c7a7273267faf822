"""The HTTP app: both APIs' routes, the operational endpoints, errors in each API's shape.

Tokenising and detokenising happen in this process, so the engine process only ever sees
token ids. ``openai_api.py`` and ``anthropic_api.py`` hold the routes of each API over the
request core in ``generate.py``.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException

from freetoken.server.anthropic_api import anthropic_routes
from freetoken.server.auth import RequireKey
from freetoken.server.errors import APIError, api_of, error_response
from freetoken.server.openai_api import openai_routes
from freetoken.server.stacks import thread_stacks
from freetoken.server.state import ServerState


def create_app(state: ServerState, api_keys: tuple[str, ...] = ()) -> Any:
    """The ASGI app; with ``api_keys`` every endpoint but /health needs one of them."""
    app = FastAPI(title="FreeToken", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(api_of(request.url.path), e.status, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", ""
        return error_response(api_of(request.url.path), 400, f"{loc}: {msg}" if loc else msg,
                              loc or None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(api_of(request.url.path), e.status_code,
                              f"{request.method} {request.url.path}: {e.detail}")

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.client.dead:
            return error_response("openai", 503, f"engine failed: {state.client.dead}")
        watch = state.client.stats.get("watchdog") or {}
        if watch.get("stuck"):  # the engine lives but makes no progress: say where it is
            return JSONResponse({"status": "stuck", "watchdog": watch}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """One model, in a shape both OpenAI's and Anthropic's clients read."""
        created = datetime.fromtimestamp(state.started, UTC).isoformat()
        name = state.model_name
        return {"object": "list", "has_more": False, "first_id": name, "last_id": name,
                "data": [{"id": name, "object": "model", "created": int(state.started),
                          "owned_by": "freetoken", "max_model_len": state.max_len,
                          "type": "model", "display_name": name, "created_at": created}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.engine_stats(state.client.stats)
        return Response(generate_latest(state.metrics.registry),
                        media_type="text/plain; version=0.0.4")

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

    app.include_router(openai_routes(state))
    app.include_router(anthropic_routes(state))
    return CountRequests(RequireKey(app, api_keys) if api_keys else app, state)


class CountRequests:
    """ASGI middleware: every HTTP response counted by path and status (``/metrics``)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.state.metrics.requests.labels(scope["path"],
                                                   str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
