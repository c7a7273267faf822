"""A conversation into prompt text through the checkpoint's chat template.

Both APIs hand over messages in the shape Hugging Face chat templates read (OpenAI's: roles
``system``/``user``/``assistant``/``tool``, an assistant's ``tool_calls`` with ``arguments``
as an object, ``reasoning_content``) and tools as OpenAI function definitions. A request
that forces a tool call gets the family's tool-call opener after the rendered prompt
(``forced``), so the model can only go on with the call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.server.errors import APIError
from freetoken.server.parsers import call_opener
from freetoken.server.state import ServerState


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]


@dataclass(frozen=True)
class ForcedCall:
    """A ``tool_choice`` that forces a tool call: of tool ``name``, or of any (the model picks)
    when None. ``field`` is the request field an error names."""

    name: str | None
    field: str = "tool_choice"


def render(state: ServerState, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None = None, prefill: bool = False,
           endpoint: str = "/v1/completions", **template_kwargs: Any) -> Prompt:
    """The prompt of ``messages``. ``prefill``: the last message is the start of the
    assistant's answer, to be continued rather than answered."""
    if state.chat_template is None:
        raise APIError(400, f"model {state.model_name!r} has no chat template; start the "
                       f"server with --chat-template FILE, or use {endpoint}")
    try:
        text = state.tokenizer.apply_chat_template(
            messages, tools=tools or None, chat_template=state.chat_template,
            add_generation_prompt=not prefill, continue_final_message=prefill,
            tokenize=False, **template_kwargs)
    except Exception as e:  # a template may raise on roles or shapes it does not support
        raise APIError(400, f"the chat template rejected these messages: {e}",
                       "messages") from e
    return tokenized(state, text)


def forced(state: ServerState, prompt: Prompt, call: ForcedCall | None) -> Prompt:
    """``prompt`` with the family's tool-call opener appended when ``call`` forces one (see
    ``OutputParser.call_opener``); the output parser, primed with the result, reads the
    opener as the start of the call. A family with no tool-call format is a 400."""
    if call is None:
        return prompt
    opener = call_opener(state.parser_family, prompt.text, call.name)
    if opener is None:
        raise APIError(400, f"{call.field}: this server cannot force a tool call for this model "
                       f"(its output parser, {state.parser_family!r}, has no tool-call format); "
                       "use 'auto' or 'none', or start the server with --output-parser naming "
                       "the model's family", call.field)
    return tokenized(state, prompt.text + opener)


def tokenized(state: ServerState, text: str) -> Prompt:
    ids = state.tokenizer(text, add_special_tokens=False).input_ids
    return Prompt(text, list(ids))
