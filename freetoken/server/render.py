"""A conversation into prompt text through the checkpoint's chat template.

Both APIs hand over messages in the shape Hugging Face chat templates read (OpenAI's: roles
``system``/``user``/``assistant``/``tool``, an assistant's ``tool_calls`` with ``arguments``
as an object, ``reasoning_content``) and tools as OpenAI function definitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.server.errors import APIError
from freetoken.server.state import ServerState


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]


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
    ids = state.tokenizer(text, add_special_tokens=False).input_ids
    return Prompt(text, list(ids))
