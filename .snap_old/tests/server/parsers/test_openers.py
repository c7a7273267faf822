"""Each family's tool-call opener: appended to a rendered prompt, the parser primed with both
reads the model's output as the rest of one call, streamed in any cut; a family without tool
markup has none."""

from __future__ import annotations

import json

import pytest

from freetoken.server.parsers import (
    PARSERS,
    ContentDelta,
    ToolCall,
    call_opener,
    collect,
    make_parser,
)
from tests.server.parsers.cases import Q, counter

ARGS = {"city": "Paris", "days": 3}
# family -> (rendered prompt, output after the named opener, output after the unnamed one)
REST = {
    "qwen3": ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
              json.dumps(ARGS) + "}\n</tool_call><|im_end|>",
              json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>"),
    "gpt_oss": ("<|start|>user<|message|>hi<|end|><|start|>assistant",
                json.dumps(ARGS) + "<|call|>",
                "get_weather <|constrain|>json<|message|>" + json.dumps(ARGS) + "<|call|>"),
    "gemma3": ("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
               'city="Paris", days=3)\n```', 'get_weather(city="Paris", days=3)\n```'),
    "gemma4": ("<|turn>user\nhi<turn|>\n<|turn>model\n",
               f"city:{Q}Paris{Q},days:3}}<tool_call|><|tool_response>",
               f"get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>"),
}


def parsed_after(family: str, prompt: str, output: str, cut: int) -> tuple[list, bool]:
    parser = make_parser(family, prompt=prompt, new_id=counter())
    events = [e for i in range(0, len(output), cut) for e in parser.feed(output[i:i + cut])]
    return events + parser.finish(), parser.malformed_tool_call


@pytest.mark.parametrize("family", sorted(REST))
@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("cut", [1, 3, 1000])
def test_output_after_the_opener_is_one_call(family, named, cut):
    prompt, after_name, after_any = REST[family]
    opener = call_opener(family, prompt, "get_weather" if named else None)
    assert opener
    events, malformed = parsed_after(family, prompt + opener,
                                     after_name if named else after_any, cut)
    out = collect(events, malformed)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == \
        [("get_weather", ARGS)]
    assert (out.content, out.reasoning, out.malformed_tool_call) == ("", "", False)


@pytest.mark.parametrize("family", sorted(REST))
def test_without_the_opener_the_same_output_is_no_call(family):
    prompt, after_name, _ = REST[family]
    events, _ = parsed_after(family, prompt, after_name, 1000)
    assert not any(isinstance(e, ToolCall) for e in events)
    assert any(isinstance(e, ContentDelta) for e in events)


def test_an_open_thought_is_closed_before_the_call():
    prompt = "<|im_start|>assistant\n<think>\n"
    opener = call_opener("qwen3", prompt, "f")
    assert opener == '</think>\n\n<tool_call>\n{"name": "f", "arguments": '
    events, _ = parsed_after("qwen3", prompt + opener, '{"a": 1}}\n</tool_call>', 1)
    assert events == [ToolCall(0, "call_0", "f", '{"a": 1}')]
    gemma4 = "<|turn>model\n<|channel>thought\n"
    assert call_opener("gemma4", gemma4, "f") == "<channel|><|tool_call>call:f{"


def test_harmony_ends_an_open_message_before_the_call():
    prompt = "<|start|>assistant<|channel|>final<|message|>Let me check."
    opener = call_opener("gpt_oss", prompt, "f")
    assert opener == ("<|end|><|start|>assistant<|channel|>commentary to=functions.f "
                      "<|constrain|>json<|message|>")
    events, _ = parsed_after("gpt_oss", prompt + opener, '{"a": 1}<|call|>', 1)
    assert events == [ToolCall(0, "call_0", "f", '{"a": 1}')]


def test_plain_has_no_opener():
    assert set(PARSERS) - set(REST) == {"plain"}
    assert call_opener("plain", "hi", "f") is None
    assert call_opener("plain", "hi", None) is None
