"""A tool call that parses, end to end through a live ``ft serve`` and the official clients:
the call comes back as ``tool_calls`` / a ``tool_use`` block, and the tool's result goes back
in the next request through the chat template, for Qwen3 (JSON in ``<tool_call>``) and
Gemma-4 (``<|tool_call>call:NAME{...}`` in Gemma's notation, its markers special tokens). Also
GPT-OSS, whose ``<|call|>`` is a stop token (generation_config.json lists it): its output ends
inside the call, which still parses.

The models are tiny checkpoints whose greedy output is fixed (``forced.py``): whatever the
prompt, they make the same call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server import forced
from tests.server.conftest import Server
from tests.server.live import (
    ANTHROPIC_TOOLS,
    ASK,
    TOOLS,
    clients,
    forced_server,
    streamed_calls,
)

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
QWEN = ["<tool_call>", "\n" + json.dumps(CALL) + "\n", "</tool_call>"]
GEMMA4 = ["<|tool_call>", "call:get_weather{", 'city:<|"|>Paris<|"|>}', "<tool_call|>"]
HARMONY = ["<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json",
           "<|message|>", json.dumps(CALL["arguments"]), "<|call|>"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.qwen3_moe(d, QWEN))


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.gemma4(d, GEMMA4))


@pytest.fixture(scope="module")
def harmony(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.gpt_oss(
        d, HARMONY, stops=("<|return|>", "<|call|>")))


def check_openai_call(oai) -> Any:
    """The call through chat completions, plain and streamed; the plain response's call."""
    choice = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    (streamed,), finish = streamed_calls(oai, tools=TOOLS)
    assert finish == "tool_calls"
    assert streamed[0] == "get_weather" and json.loads(streamed[1]) == {"city": "Paris"}
    return call


def check_anthropic_call(anth) -> Any:
    reply = anth.messages.create(model="m", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS)
    assert reply.stop_reason == "tool_use"
    (block,) = [b for b in reply.content if b.type != "text" or b.text]
    assert block.type == "tool_use" and block.id
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"})
    with anth.messages.stream(model="m", max_tokens=64, messages=ASK,
                              tools=ANTHROPIC_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [("get_weather", {"city": "Paris"})]
    return block


FAMILIES = ["qwen", "gemma4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_call_and_its_result_round_trip_through_openai(family, request):
    oai, _ = clients(request.getfixturevalue(family))
    call = check_openai_call(oai)

    def answered(result: str):
        said = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]}
        back = {"role": "tool", "tool_call_id": call.id, "content": result}
        return oai.chat.completions.with_raw_response.create(
            model="m", messages=[*ASK, said, back], tools=TOOLS)

    first = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    short, long = answered("sunny"), answered("sunny" + "X" * 10)
    assert short.http_response.status_code == long.http_response.status_code == 200
    short, long = short.parse(), long.parse()
    # the result is in the prompt, byte for byte: ten more bytes are ten more tokens
    assert long.usage.prompt_tokens - short.usage.prompt_tokens == 10
    assert short.usage.prompt_tokens > first.usage.prompt_tokens + len("sunny")
    assert short.choices[0].message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_call_and_its_result_round_trip_through_anthropic(family, request):
    _, anth = clients(request.getfixturevalue(family))
    block = check_anthropic_call(anth)

    def answered(result: str) -> list[dict[str, Any]]:
        return [*ASK,
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": block.id, "name": block.name,
                     "input": block.input}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": block.id, "content": result}]}]

    def count(messages: list[dict[str, Any]]) -> int:
        return anth.messages.count_tokens(model="m", messages=messages,
                                          tools=ANTHROPIC_TOOLS).input_tokens

    assert count(answered("sunny" + "X" * 10)) - count(answered("sunny")) == 10
    assert count(answered("sunny")) > count(ASK) + len("sunny")
    raw = anth.messages.with_raw_response.create(
        model="m", max_tokens=64, messages=answered("sunny"), tools=ANTHROPIC_TOOLS)
    assert raw.http_response.status_code == 200
    reply = raw.parse()
    assert reply.usage.input_tokens == count(answered("sunny"))
    assert reply.stop_reason == "tool_use"


def test_harmony_call_ends_at_its_call_stop_token_and_still_parses(harmony):
    oai, anth = clients(harmony)
    check_openai_call(oai)
    check_anthropic_call(anth)
    # the output stops at <|call|>: generation_config.json made it a stop token, and the
    # model's own EOS after it is never generated
    done = httpx.post(f"{harmony.url}/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": ASK, "tools": TOOLS}).json()
    assert done["usage"]["completion_tokens"] == len(HARMONY)
    assert done["choices"][0]["finish_reason"] == "tool_calls"


def test_gemma4_named_tool_choice_prefills_the_call_up_to_its_arguments(gemma4):
    oai, anth = clients(gemma4)
    auto = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    named = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    # <|tool_call> and call:get_weather{ are the prompt's: the model writes the rest
    assert named.usage.prompt_tokens == auto.usage.prompt_tokens + 2
    assert named.usage.completion_tokens == auto.usage.completion_tokens - 2 == len(GEMMA4) - 1
    reply = anth.messages.create(model="m", max_tokens=64, messages=ASK, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert [(b.name, b.input) for b in reply.content] == [("get_weather", {"city": "Paris"})]
