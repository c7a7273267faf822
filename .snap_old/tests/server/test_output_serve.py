"""The output parser of a live ``ft serve``: chosen from the checkpoint, overridden by
``--output-parser``, fed special tokens where the family's markers are special, and a broken
tool call's finish, read through the official clients.

The models are tiny checkpoints whose greedy output is fixed (``forced.py``), so what the parser
sees is known without luck.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import forced
from tests.server.conftest import Server
from tests.server.live import ASK, clients, forced_server, serve

HARMONY = ["<|channel|>", "analysis", "<|message|>", "hmm", "<|end|>", "hi"]
BROKEN_CALL = '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'
QWEN = ["<think>", "hmm", "</think>", "hi", "<tool_call>", '{"name": "f", "arguments": {"a": 1',
        "</tool_call>"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return forced.gpt_oss(tmp_path_factory.mktemp("forced") / "gpt_oss", HARMONY)


@pytest.fixture(scope="module")
def harmony(harmony_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = serve(harmony_dir, tmp_path_factory.mktemp("serve") / "harmony.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def broken_call(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from forced_server(tmp_path_factory, lambda d: forced.qwen3_moe(d, QWEN))


def openai_stream(client, **kw) -> tuple[str, str, str | None]:
    """(content, reasoning, finish_reason) of a streamed chat completion."""
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(model="m", messages=ASK, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
        finish = choice.finish_reason or finish
    return content, reasoning, finish


def test_harmony_markers_reach_the_parser_and_end_of_turn_never_the_content(harmony):
    oai, anth = clients(harmony)
    assert "output parser: gpt_oss (the checkpoint's architecture, gpt_oss)" in \
        harmony.log.read_text()
    msg = oai.chat.completions.create(model="m", messages=ASK).choices[0]
    assert (msg.message.content, msg.message.model_extra["reasoning_content"]) == ("hi", "hmm")
    assert msg.finish_reason == "stop"
    assert openai_stream(oai) == ("hi", "hmm", "stop")
    reply = anth.messages.create(model="m", max_tokens=32, messages=ASK)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in reply.content] == [("thinking", "hmm"), ("text", "hi")]
    assert reply.stop_reason == "end_turn"
    with anth.messages.stream(model="m", max_tokens=32, messages=ASK) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert streamed.content[1].text == "hi"
    # the plain-text path skips special tokens as before
    done = oai.completions.create(model="m", prompt="hello", max_tokens=32)
    assert done.choices[0].text == "analysishmmhi"


def test_output_parser_flag_overrides_the_family_and_plain_gets_no_special_tokens(
        harmony_dir, tmp_path):
    server = serve(harmony_dir, tmp_path / "plain.log", "--output-parser", "plain")
    try:
        assert "output parser: plain (--output-parser)" in server.log.read_text()
        oai, anth = clients(server)
        msg = oai.chat.completions.create(model="m", messages=ASK).choices[0].message
        assert msg.content == "analysishmmhi"
        assert "reasoning_content" not in (msg.model_extra or {})
        assert openai_stream(oai) == ("analysishmmhi", "", "stop")
        reply = anth.messages.create(model="m", max_tokens=32, messages=ASK)
        assert [(b.type, b.text) for b in reply.content] == [("text", "analysishmmhi")]
    finally:
        server.stop()


def test_a_broken_tool_call_is_text_with_a_malformed_tool_call_finish(broken_call):
    oai, anth = clients(broken_call)
    assert "output parser: qwen3 (the checkpoint's architecture, qwen3_moe)" in \
        broken_call.log.read_text()
    choice = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS).choices[0]
    assert choice.finish_reason == "malformed_tool_call"
    assert choice.message.content == "hi" + BROKEN_CALL
    assert not choice.message.tool_calls
    assert choice.message.model_extra["reasoning_content"] == "hmm"
    assert openai_stream(oai, tools=TOOLS) == ("hi" + BROKEN_CALL, "hmm", "malformed_tool_call")
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    reply = anth.messages.create(model="m", max_tokens=32, messages=ASK, tools=tools)
    assert reply.stop_reason == "malformed_tool_call"
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[1].text == "hi" + BROKEN_CALL
    with anth.messages.stream(model="m", max_tokens=32, messages=ASK, tools=tools) as s:
        assert s.get_final_message().stop_reason == "malformed_tool_call"
    # cut by max_tokens, the call is broken because of the limit: the finish says so
    cut = oai.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=6)
    assert cut.choices[0].finish_reason == "length"


def test_unknown_output_parser_is_a_one_line_error():
    run = subprocess.run([sys.executable, "-m", "freetoken.cli", "serve", "--output-parser",
                          "hermes"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "ft serve: error: --output-parser: unknown output parser 'hermes' (choose from "
        "gemma3, gemma4, gpt_oss, plain, qwen3)"]
