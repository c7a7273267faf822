"""Forced tool choice through a live ``ft serve`` and the official clients: OpenAI
``"required"`` and a named function, Anthropic ``any`` and ``tool``, come back as the named
tool's call, for Qwen3, GPT-OSS (harmony) and Gemma-3 (a ``tool_code`` block); ``"none"``
offers no tools; a choice that cannot be served is a 400 naming it.

The models are tiny checkpoints whose output is fixed (``forced.py``): each chain token is
followed by the next whatever came before, so a prompt that ends with the family's tool-call
opener (whose last token is a chain token) makes the model go on from there. The opener is
seen in the counts: the prompt grows by its tokens and the output shrinks by as many.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.server import forced
from tests.server.conftest import Server
from tests.server.live import (
    ANTHROPIC_TOOLS,
    ASK,
    TOOLS,
    assert_weather_call,
    clients,
    forced_server,
    serve,
    streamed_calls,
)

# The Qwen3 call cut where the openers end: "<tool_call>\n" (any tool), then the call's JSON
# up to its arguments (a named one).
QWEN = ["<tool_call>\n", '{"name": "get_weather", "arguments": ', '{"city": "Paris"}}',
        "\n</tool_call>"]
# A template that writes the tools' names, so whether tools were offered shows in the prompt.
TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') | "
            "map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}" + forced.QWEN_TEMPLATE)
# GPT-OSS's call cut where the openers end: the header up to ``functions.`` (any tool), then
# the name and the rest of the header (a named one).
HARMONY = ["<|channel|>", "commentary to=functions.", "get_weather ", "<|constrain|>", "json",
           "<|message|>", json.dumps({"city": "Paris"}), "<|call|>"]
# Gemma-3's: the tool_code fence (any tool), then the call up to its arguments (a named one).
GEMMA3 = ["```tool_code\n", "get_weather(", 'city="Paris")\n', "```"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return forced.qwen3_moe(tmp_path_factory.mktemp("forced") / "qwen3_moe", QWEN)


@pytest.fixture(scope="module")
def qwen(qwen_dir: Path) -> Iterator[Server]:
    template = qwen_dir / "tools.jinja"
    template.write_text(TEMPLATE)
    server = serve(qwen_dir, qwen_dir / "serve.log", "--chat-template", str(template))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.gpt_oss(
        d, HARMONY, stops=("<|return|>", "<|call|>")))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.gemma3(d, GEMMA3))


def forced_call(oai, **kw):
    """(the choice, usage) of a chat completion offering the tools."""
    r = oai.chat.completions.create(model="m", messages=ASK, tools=[*TOOLS, OTHER], **kw)
    return r.choices[0], r.usage


def assert_forced_openai_calls(oai, auto, openers: tuple[int, int]) -> None:
    """``required`` and the named choice each give the weather call, whole and streamed, with
    the opener's tokens (``openers``: for each choice) moved from the output into the prompt
    (``auto``: the usage without forcing)."""
    for choice, opener_tokens in zip(("required", NAMED), openers, strict=True):
        made, usage = forced_call(oai, tool_choice=choice)
        assert_weather_call(made)
        assert usage.prompt_tokens == auto.prompt_tokens + opener_tokens
        assert usage.completion_tokens == auto.completion_tokens - opener_tokens
        (streamed,), finish = streamed_calls(oai, tools=[*TOOLS, OTHER], tool_choice=choice)
        assert finish == "tool_calls"
        assert streamed[0] == "get_weather" and json.loads(streamed[1]) == {"city": "Paris"}


def test_openai_required_and_named_tool_choice_are_served(qwen):
    oai, _ = clients(qwen)
    free, auto = forced_call(oai)
    assert_weather_call(free)  # the model calls of itself: the whole chain, then its end
    assert auto.completion_tokens == len(QWEN) + 1
    assert_forced_openai_calls(oai, auto, (1, 2))


def test_openai_tool_choice_none_offers_no_tools(qwen):
    oai, _ = clients(qwen)
    bare = oai.chat.completions.create(model="m", messages=ASK)
    _, offered = forced_call(oai)
    none, usage = forced_call(oai, tool_choice="none")
    assert usage.prompt_tokens == bare.usage.prompt_tokens < offered.prompt_tokens
    # nor are calls read from the output: the markup is text
    assert not none.message.tool_calls and none.finish_reason == "stop"
    assert none.message.content == "".join(QWEN)


@pytest.mark.parametrize("choice, param", [
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    ({"type": "function", "name": "get_weather"}, "tool_choice"),
    ("always", "tool_choice"),
])
def test_openai_tool_choice_that_names_no_tool_is_a_400(qwen, choice, param):
    r = httpx.post(f"{qwen.url}/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    r = httpx.post(f"{qwen.url}/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": ASK, "tool_choice": "required"})
    assert r.status_code == 400 and "needs tools" in r.json()["error"]["message"]


def test_anthropic_any_and_named_tool_choice_are_served(qwen):
    _, anth = clients(qwen)
    tools = [*ANTHROPIC_TOOLS, {"name": "other", "input_schema": {"type": "object"}}]

    def count(**kw) -> int:
        return anth.messages.count_tokens(model="m", messages=ASK, tools=tools,
                                          **kw).input_tokens

    auto = count()
    for choice, opener_tokens in (({"type": "any"}, 1),
                                  ({"type": "tool", "name": "get_weather"}, 2)):
        assert count(tool_choice=choice) == auto + opener_tokens
        reply = anth.messages.create(model="m", max_tokens=64, messages=ASK, tools=tools,
                                     tool_choice=choice)
        assert reply.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in reply.content] == \
            [("tool_use", "get_weather", {"city": "Paris"})]
        assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == \
            auto + opener_tokens
        assert reply.usage.output_tokens == len(QWEN) + 1 - opener_tokens
        with anth.messages.stream(model="m", max_tokens=64, messages=ASK, tools=tools,
                                  tool_choice=choice) as s:
            final = s.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [(b.name, b.input) for b in final.content] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("change, param", [
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "any"}, "tools": None}, "tool_choice"),
])
def test_anthropic_tool_choice_that_names_no_tool_is_a_400(qwen, change, param):
    body = {"model": "m", "max_tokens": 8, "messages": ASK, "tools": ANTHROPIC_TOOLS} | change
    r = httpx.post(f"{qwen.url}/v1/messages", json={k: v for k, v in body.items() if v},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param)


@pytest.mark.parametrize("family, openers", [("harmony", (2, 6)), ("gemma3", (1, 2))])
def test_required_and_named_tool_choice_are_served_per_family(family, openers, request):
    """GPT-OSS: the commentary header up to ``functions.`` (required) or to its JSON body
    (named) is the prompt's; Gemma-3: the tool_code fence, then the call up to its
    arguments."""
    oai, anth = clients(request.getfixturevalue(family))
    free, auto = forced_call(oai)
    assert_weather_call(free)  # the model calls of itself: the whole chain, then its end
    assert_forced_openai_calls(oai, auto, openers)
    tools = [*ANTHROPIC_TOOLS, {"name": "other", "input_schema": {"type": "object"}}]
    for choice, opener_tokens in zip(({"type": "any"}, {"type": "tool", "name": "get_weather"}),
                                     openers, strict=True):
        reply = anth.messages.create(model="m", max_tokens=64, messages=ASK, tools=tools,
                                     tool_choice=choice)
        assert reply.stop_reason == "tool_use"
        assert [(b.type, b.name, b.input) for b in reply.content] == \
            [("tool_use", "get_weather", {"city": "Paris"})]
        assert reply.usage.output_tokens == auto.completion_tokens - opener_tokens
        with anth.messages.stream(model="m", max_tokens=64, messages=ASK, tools=tools,
                                  tool_choice=choice) as s:
            final = s.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [("get_weather", {"city": "Paris"})]


def test_a_family_without_tool_calls_refuses_forced_choice(qwen_dir, tmp_path):
    server = serve(qwen_dir, tmp_path / "plain.log", "--output-parser", "plain")
    try:
        oai, anth = clients(server)
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": ASK, "tools": TOOLS, "tool_choice": "required"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tool_choice"
        assert "'plain'" in r.json()["error"]["message"]
        with pytest.raises(anthropic.BadRequestError) as e:
            anth.messages.create(model="m", max_tokens=8, messages=ASK, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "any"})
        assert e.value.body["error"]["message"].startswith("tool_choice: ")
        # auto is still served: the call stays text
        auto = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
        assert auto.choices[0].message.content == "".join(QWEN)
    finally:
        server.stop()
