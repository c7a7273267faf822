"""API keys: with ``--api-key``, every endpoint but ``/health`` needs one.

A client sends it as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key: KEY``
(Anthropic's). A missing or wrong key is a 401 in the shape of the API the path belongs to.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from freetoken.errors import ConfigError
from freetoken.server.errors import api_of, error_response

OPEN_PATHS = frozenset({"/health"})


def load_keys(keys: list[str] | None, files: list[str] | None) -> tuple[str, ...]:
    """The keys of ``--api-key`` and of each ``--api-key-file`` (one a line; blank lines and
    lines starting with ``#`` skipped)."""
    out = [k.strip() for k in keys or []]
    for name in files or []:
        path = Path(name)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"--api-key-file {path}: {e.strerror}") from e
        out += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if any(not k for k in out):
        raise ConfigError("--api-key must not be empty")
    return tuple(out)


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Compare against every key in constant time per key, so timing tells nothing."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(given.encode(), k.encode())
    return ok


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name == b"x-api-key":
            return value.decode("latin-1")
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
    return None


class RequireKey:
    """ASGI middleware that lets a request through only with one of ``keys``."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = presented_key(scope["headers"])
        if given is not None and key_matches(given, self.keys):
            return await self.app(scope, receive, send)
        why = "no API key given" if given is None else "the API key is not valid"
        response = error_response(api_of(scope["path"]), 401, f"{why}: send it as "
                                  "'Authorization: Bearer KEY' or 'x-api-key: KEY'")
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)
