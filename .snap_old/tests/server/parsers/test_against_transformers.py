"""Our parsers against code we did not write: transformers' chat-template renderer and its own
response parser (its built-in templates for Qwen and Gemma 4).

Conversations with tool calls are rendered to text, the assistant's part is parsed back, and the
result must equal the message that was rendered and what transformers' parser reads from the
same text. Its parser is simpler than ours (a closer inside a JSON string ends its call, text
between calls is overwritten), so the generated conversations stay inside what both read alike;
the recorded cases cover the rest.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from freetoken.server.parsers import parse_text
from freetoken.server.parsers.gemma_values import write_value

pytest.importorskip("jinja2")
utils = pytest.importorskip("transformers.cli.serving.utils")
from transformers.utils.chat_parsing import parse_response  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

RESPONSE_TEMPLATES = {types[0]: t for types, t in utils._RESPONSE_TEMPLATE_FALLBACKS.items()}

# Qwen3's layout of a turn: ChatML roles, reasoning in <think>, one <tool_call> block per call
# with the arguments written by the template's tojson, tool results in a user turn. The thinking
# switch opens <think> in the generation prompt.
QWEN3_TEMPLATE = """\
{%- for m in messages -%}
{{- '<|im_start|>' + m.role + '\\n' -}}
{%- if m.role == 'assistant' -%}
  {%- if m.reasoning_content or open_think -%}
    {{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}
  {%- endif -%}
  {{- m.content -}}
  {%- for tc in m.tool_calls or [] -%}
    {%- if m.content or not loop.first %}{{ '\\n' }}{% endif -%}
    {{- '<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' -}}
    {{- tc.function.arguments | tojson -}}
    {{- '}\\n</tool_call>' -}}
  {%- endfor -%}
{%- else -%}
  {{- m.content -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if open_think %}{{ '<think>\\n' }}{% endif -%}
{%- endif -%}"""

WORDS = ["Paris", "naïve", "東京", "a{b}", "[x]", 'say "hi"', "back\\slash", "tab\there", "🙂"]


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.choice(["str", "int", "float", "bool", "none"] + ["list", "dict"] * (depth < 2))
    if kind == "str":
        return " ".join(rng.sample(WORDS, rng.randint(1, 3)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-3, 12345.678])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return _args(rng, depth + 1)


def _args(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = ["city", "days", "filter", "q", "opts", "n_2"]
    return {k: _value(rng, depth) for k in rng.sample(keys, rng.randint(0, 4))}


def _message(rng: random.Random) -> dict[str, Any]:
    calls = [{"type": "function", "function": {"name": rng.choice(["get_weather", "search", "f"]),
                                               "arguments": _args(rng)}}
             for _ in range(rng.choice([0, 1, 1, 2, 3]))]
    return {"role": "assistant",
            "reasoning_content": rng.choice(["", "The user wants {x}.", "Plan:\n1. look\n2. say"]),
            "content": rng.choice(["", "Sure, checking.", "Line one\nline <b>two</b>"]),
            "tool_calls": calls}


def _oracle(text: str, family: str, prefix: str) -> tuple[str, str, list]:
    r = parse_response(text, RESPONSE_TEMPLATES[family], prefix=prefix)
    calls = [(t["function"]["name"], t["function"]["arguments"]) for t in r.get("tool_calls") or []]
    return r.get("content", ""), r.get("reasoning_content", ""), calls


def _ours(text: str, family: str, prompt: str) -> tuple[str, str, list]:
    out = parse_text(family, text, prompt=prompt)
    assert not out.malformed_tool_call
    return out.content, out.reasoning, [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _meaning(m: dict[str, Any]) -> tuple[str, str, list]:
    return (m["content"], m["reasoning_content"],
            [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])


@pytest.mark.parametrize("open_think", [False, True])
def test_rendered_qwen3_turns_parse_back(open_think):
    rng = random.Random(open_think)
    user = {"role": "user", "content": "What is the weather?"}
    checked = 0
    for _ in range(150):
        msg = _message(rng)
        if open_think and not msg["reasoning_content"]:
            msg["reasoning_content"] = "x"
        prompt, _ = render_jinja_template([[user]], chat_template=QWEN3_TEMPLATE,
                                          add_generation_prompt=True, open_think=open_think)
        full, _ = render_jinja_template([[user, msg]], chat_template=QWEN3_TEMPLATE,
                                        open_think=open_think)
        prompt, full = prompt[0], full[0]
        assert full.startswith(prompt)
        completion = full[len(prompt):]
        assert completion.startswith("<think>") is (bool(msg["reasoning_content"])
                                                     and not open_think)
        ours = _ours(completion, "qwen3", prompt)
        assert ours == _meaning(msg), completion
        # its parser lets the empty text before <|im_end|> overwrite the content: leave it off
        assert ours == _oracle(completion.removesuffix("<|im_end|>\n"), "qwen2", prompt)
        checked += len(msg["tool_calls"])
    assert checked > 100


def test_gemma4_turns_agree_with_transformers():
    rng = random.Random(4)
    prompt = "<|turn>user\nWhat is the weather?<turn|>\n<|turn>model\n"
    checked = 0
    for _ in range(150):
        msg = _message(rng)
        text = (f"<|channel>thought\n{msg['reasoning_content']}<channel|>"
                if msg["reasoning_content"] else "")
        text += msg["content"]
        for c in msg["tool_calls"]:
            f = c["function"]
            text += f"<|tool_call>call:{f['name']}{write_value(f['arguments'])}<tool_call|>"
        text += "<|tool_response>" if msg["tool_calls"] else "<turn|>"
        ours = _ours(text, "gemma4", prompt)
        assert ours == _meaning(msg), text
        assert ours == _oracle(text, "gemma4", prompt), text
        checked += len(msg["tool_calls"])
    assert checked > 100
