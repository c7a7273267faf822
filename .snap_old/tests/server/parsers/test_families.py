"""Each family's recorded outputs parse to what they mean; the family table and its errors."""

from __future__ import annotations

import json

import pytest

from freetoken.errors import ConfigError
from freetoken.server.parsers import (
    PARSERS,
    ContentDelta,
    ReasoningDelta,
    ToolCall,
    make_parser,
    parse_text,
    parser_family,
    parser_names,
)
from tests.server.parsers.cases import CASES, Case, counter


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_recorded_output_parses_to_its_meaning(case: Case):
    out = parse_text(case.family, case.text, prompt=case.prompt, new_id=counter())
    assert out.content == case.content
    assert out.reasoning == case.reasoning
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == list(case.calls)
    assert [(c.index, c.id) for c in out.tool_calls] == [
        (i, f"call_{i}") for i in range(len(case.calls))]
    assert out.malformed_tool_call is case.malformed


def test_every_family_has_a_case():
    assert {c.family for c in CASES} == set(PARSERS)


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss", "gemma3", "gemma4"])
def test_without_tools_a_call_stays_text(family):
    case = next(c for c in CASES if c.family == family and c.calls and not c.prompt)
    out = parse_text(family, case.text, tools=False)
    assert out.tool_calls == () and not out.malformed_tool_call
    assert case.calls[0][0] in out.content


def test_text_is_held_back_only_while_it_could_be_a_marker():
    p = make_parser("qwen3")
    assert p.feed("Hello <tool") == [ContentDelta("Hello")]
    assert p.feed("s") == [ContentDelta(" <tools")]
    assert p.feed(" <think") == []
    assert p.feed(">\nwhy") == [ReasoningDelta("why")]
    p = make_parser("gpt_oss")
    assert p.feed("<|channel|>final<|message|>Hi <|") == [ContentDelta("Hi")]
    assert p.feed("x") == [ContentDelta(" <|x")]
    assert p.feed("<|ret") == []
    assert p.finish() == [ContentDelta("<|ret")]


def test_trailing_whitespace_waits_for_more_text():
    p = make_parser("qwen3")
    assert p.feed("a \n") == [ContentDelta("a")]
    assert p.feed("b") == [ContentDelta(" \nb")]
    assert p.feed("\n\n") == []
    assert p.finish() == []


def test_a_call_is_emitted_when_it_closes_not_before():
    p = make_parser("qwen3", new_id=counter())
    assert p.feed('<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}}') == []
    assert p.feed("\n</tool_") == []
    assert p.feed("call>") == [ToolCall(0, "call_0", "f", '{"s": "</tool_call>"}')]


def test_family_from_architecture_names():
    for arch in ("qwen3", "qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM", "qwen2", "qwen3-next"):
        assert parser_family(arch) == "qwen3", arch
    for arch in ("gpt_oss", "gpt-oss", "GptOssForCausalLM", "gptoss"):
        assert parser_family(arch) == "gpt_oss", arch
    assert parser_family("gemma3") == parser_family("Gemma3ForConditionalGeneration") == "gemma3"
    assert parser_family("gemma4") == parser_family("gemma4_text") == "gemma4"
    assert parser_family("llama") == parser_family(None) == "plain"


def test_override_by_parser_or_architecture_name():
    assert parser_family("qwen3moe", "plain") == "plain"
    assert parser_family("llama", "gpt-oss") == "gpt_oss"
    with pytest.raises(ConfigError) as e:
        parser_family("qwen3", "hermes")
    assert str(e.value) == ("unknown output parser 'hermes' (choose from "
                            + ", ".join(parser_names()) + ")")
    assert parser_names() == ["gemma3", "gemma4", "gpt_oss", "plain", "qwen3"]
    with pytest.raises(ConfigError, match="choose from gemma3"):
        make_parser("qwen")


def test_finish_is_final():
    p = make_parser("qwen3")
    p.finish()
    assert p.finish() == []
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")
