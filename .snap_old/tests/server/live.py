"""Live servers on forced checkpoints (``forced.py``) and the official clients: what the
server tests that drive a tiny fixed-output model share."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import Server, start_server

SERVE = ["--served-model-name", "m", "--max-seq-len", "256", "--kv-tokens", "2048",
         "--max-running-requests", "4", "--max-prefill-length", "128"]
ASK = [{"role": "user", "content": "hello there"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather now",
                    "input_schema": SCHEMA}]


def serve(model: Path, log: Path, *extra: str) -> Server:
    return start_server(["--model", str(model), *SERVE, *extra], log)


def forced_server(factory: pytest.TempPathFactory, build: Callable[[Path], Path],
                  *extra: str) -> Iterator[Server]:
    """A module fixture's body: a server on the checkpoint ``build`` writes into a fresh
    directory (given the directory), stopped at the end."""
    d = factory.mktemp("forced")
    server = serve(build(d / "model"), d / "serve.log", *extra)
    yield server
    server.stop()


def clients(server: Server) -> tuple[Any, Any]:
    from anthropic import Anthropic
    from openai import OpenAI

    return (OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120),
            Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120))


def streamed_calls(client: Any, **kw: Any) -> tuple[list[tuple[str, str]], str | None]:
    """((name, arguments) per call index, finish_reason) from a streamed chat completion."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(model="m", messages=ASK, stream=True, **kw):
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, ["", ""])
            call[0] += (d.function.name or "") if d.function else ""
            call[1] += (d.function.arguments or "") if d.function else ""
        finish = choice.finish_reason or finish
    return [(n, a) for _, (n, a) in sorted(calls.items())], finish


def assert_weather_call(choice: Any) -> None:
    """A chat choice that is one call of get_weather for Paris and nothing else."""
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
