"""Errors in the shape of the API a request spoke.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic (every path under
``/v1/messages``): ``{"type": "error", "error": {"type", "message"}}``. The type follows the
status, so a route raises ``APIError(status, message, param)`` and never picks the shape.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse

Api = Literal["openai", "anthropic"]

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                    529: "overloaded_error"}


class APIError(Exception):
    """A request that cannot be served: the status, what was wrong and what to do, and the
    request field at fault (``param``) when there is one."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def api_of(path: str) -> Api:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(api: Api, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500
                                    else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500
                             else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(api: Api, status: int, message: str,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(api, status, message, param), status_code=status)
