"""Request bodies of the OpenAI API subset we serve (pydantic models).

Unknown fields are ignored, as OpenAI-compatible servers do; fields we know but do not serve
are refused by ``unserved`` with a 400 that names them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from freetoken.server.errors import APIError
from freetoken.server.render import ForcedCall

MAX_CHOICES = 16  # n at most: each choice is a sequence in the batch, with its own KV


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def logprob_count(self) -> int | None:
        """Top log-probabilities per token to return (None: no logprobs at all)."""
        return None

    def unserved(self) -> None:
        """A 400 naming the first field asked for that this server does not serve."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCallIn(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, object]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""

    def for_template(self, i: int) -> dict[str, Any]:
        """This message as chat templates read it (a tool call's arguments as an object)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments,
                                            f"messages.{i}.tool_calls.{j}.function.arguments")}}
                for j, c in enumerate(self.tool_calls)]
        return msg


def _arguments(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise APIError(400, f"{where}: not valid JSON ({e.msg})", where) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{where}: must be a JSON object", where)
    return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unserved(self) -> None:
        super().unserved()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise APIError(400, f"response_format {kind!r} is not supported (only 'text'): "
                           "this server does not constrain output to JSON", "response_format")
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function" or not isinstance(tool.get("function"), dict) \
                    or not tool["function"].get("name"):
                raise APIError(400, f"tools.{i}: expected {{'type': 'function', 'function': "
                               "{'name': ..., 'parameters': {...}}}", f"tools.{i}")
        self.forced_call()

    def forced_call(self) -> ForcedCall | None:
        """The call ``tool_choice`` forces (``"required"``: any tool; ``{"type": "function",
        "function": {"name": ...}}``: that one), or None; a 400 for a choice that names no
        tool of ``tools`` or is not one of these."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if not self.tools:
            raise APIError(400, f"tool_choice {choice!r} needs tools to call; send tools or "
                           "use 'auto'", "tool_choice")
        if choice == "required":
            return ForcedCall(None)
        if not (isinstance(choice, dict) and choice.get("type") == "function"
                and isinstance(choice.get("function"), dict)):
            raise APIError(400, f"tool_choice {choice!r} is not supported (use 'auto', 'none', "
                           "'required' or {'type': 'function', 'function': {'name': ...}})",
                           "tool_choice")
        name, names = choice["function"].get("name"), [t["function"]["name"] for t in self.tools]
        if name not in names:
            raise APIError(400, f"tool_choice.function.name {name!r} is not one of tools "
                           f"(choose from {', '.join(names)})", "tool_choice.function.name")
        return ForcedCall(name)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.tool_choice == "none" else self.tools


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unserved(self) -> None:
        super().unserved()
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", name)
        if (self.best_of or 1) > 1:
            raise APIError(400, "best_of > 1 is not supported", "best_of")
