"""Request bodies of the Anthropic Messages API, and the conversation they carry turned into
the messages chat templates read.

Unknown fields are refused (as Anthropic's API does), so a client learns at once what this
server does not serve. Content blocks are checked one by one so an error names the block:
``messages.1.content.0.type: ...``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from freetoken.server.errors import APIError
from freetoken.server.render import ForcedCall
from freetoken.server.signing import ThinkingSigner


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock, "redacted_thinking": RedactedThinkingBlock}
ROLE_BLOCKS = {"user": ("text", "tool_result"),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


MIN_THINKING_BUDGET = 1024  # Anthropic's floor on thinking.budget_tokens


class Thinking(_Strict):
    """``enabled`` caps the reasoning at ``budget_tokens`` (see ``thought_budget.py``);
    ``adaptive`` lets the model think as long as it likes; ``disabled`` renders the prompt with
    thinking off where the chat template has the switch (``enable_thinking``)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None

    def check(self, max_tokens: int | None) -> None:
        """Anthropic's rule: ``enabled`` needs a budget of at least 1024 and below
        ``max_tokens``; the other types take none."""
        field = "thinking.budget_tokens"
        if self.type != "enabled":
            if self.budget_tokens is not None:
                raise APIError(400, f"{field}: only thinking.type 'enabled' takes a budget "
                               f"(this one is {self.type!r}); drop it", field)
            return
        if self.budget_tokens is None:
            raise APIError(400, f"{field}: required when thinking.type is 'enabled'; send "
                           f"a budget of at least {MIN_THINKING_BUDGET}", field)
        if self.budget_tokens < MIN_THINKING_BUDGET:
            raise APIError(400, f"{field}: {self.budget_tokens} is below the minimum of "
                           f"{MIN_THINKING_BUDGET}; send at least {MIN_THINKING_BUDGET}", field)
        if max_tokens is not None and self.budget_tokens >= max_tokens:
            raise APIError(400, f"{field}: {self.budget_tokens} must be less than max_tokens "
                           f"({max_tokens}); raise max_tokens or lower the budget", field)


class CountTokensRequest(_Strict):
    # fields about billing, placement and caching on Anthropic's side: accepted, no effect here
    cache_control: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    def conversation(self, signer: ThinkingSigner) -> list[dict[str, Any]]:
        """The messages as chat templates read them (OpenAI's roles and tool calls); a
        thinking block must carry the signature ``signer`` gave its text."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else \
                "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        called: dict[str, str] = {}  # tool_use id -> tool name, from earlier assistant turns
        for i, msg in enumerate(self.messages):
            out += _turn(i, msg, called, signer)
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools or (self.tool_choice and self.tool_choice.type == "none"):
            return None
        return [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in self.tools]

    def thinking_on(self) -> bool:
        return self.thinking is not None and self.thinking.type != "disabled"

    output_config: dict[str, Any] | None = None

    def thinking_budget(self) -> int | None:
        """The cap on the reasoning's tokens, or None (thinking off, or adaptive)."""
        if self.thinking is None or self.thinking.type != "enabled":
            return None
        return self.thinking.budget_tokens

    def unserved(self) -> None:
        if (self.output_config or {}).get("format"):
            raise APIError(400, "output_config.format is not supported: this server does not "
                           "constrain output to a JSON schema", "output_config.format")
        if self.thinking is not None:
            self.thinking.check(getattr(self, "max_tokens", None))
        self.forced_call()

    def forced_call(self) -> ForcedCall | None:
        """The call ``tool_choice`` forces (``any``: a tool the model picks; ``tool``: the one
        named), or None; a 400 when there are no tools or the name is not one of them."""
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none"):
            return None
        if not self.tools:
            raise APIError(400, f"tool_choice.type {choice.type!r} needs tools to call; send "
                           "tools or use 'auto'", "tool_choice")
        if choice.type == "any":
            return ForcedCall(None)
        names = [t.name for t in self.tools]
        if choice.name not in names:
            raise APIError(400, f"tool_choice.name {choice.name!r} is not one of tools "
                           f"(choose from {', '.join(names)})", "tool_choice.name")
        return ForcedCall(choice.name)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False


def _turn(i: int, msg: InputMessage, called: dict[str, str],
          signer: ThinkingSigner) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if not msg.content:
        raise APIError(400, f"messages.{i}.content: a list of blocks must not be empty",
                       f"messages.{i}.content")
    text, reasoning, calls, results = [], [], [], []
    for j, raw in enumerate(msg.content):
        block = _block(f"messages.{i}.content.{j}", raw, ROLE_BLOCKS[msg.role])
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if not signer.valid(block.thinking, block.signature):
                where = f"messages.{i}.content.{j}.signature"
                raise APIError(400, f"{where}: does not match the block's thinking (this server "
                               "did not write it, it was edited, or the server restarted "
                               "since); send thinking blocks back exactly as returned, or "
                               "drop them", where)
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            called[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                where = f"messages.{i}.content.{j}.tool_use_id"
                raise APIError(400, f"{where}: no earlier tool_use block has id "
                               f"{block.tool_use_id!r}", where)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "name": called[block.tool_use_id], "content": block.text()})
    if msg.role == "user":
        return results + ([{"role": "user", "content": "".join(text)}] if text else [])
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _block(where: str, raw: dict[str, Any], allowed: tuple[str, ...]) -> Block:
    kind = raw.get("type")
    if kind not in allowed:
        what = f"{kind!r} blocks are" if isinstance(kind, str) else "a block without a type is"
        raise APIError(400, f"{where}.type: {what} not supported here (choose from "
                       f"{', '.join(allowed)})", f"{where}.type")
    try:
        return BLOCKS[kind].model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join([where, *(str(x) for x in first["loc"])])
        raise APIError(400, f"{loc}: {first['msg']}", loc) from None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text) as a ``tool_use`` block's input object."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
