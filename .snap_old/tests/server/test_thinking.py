"""Anthropic ``thinking`` through a live ``ft serve`` and the official client: a budget caps
the reasoning (the family's thought closer forced once it is spent, then the answer),
``disabled`` renders the template's thinking switch off, thinking blocks come back signed
and a block sent back is checked against its signature; budgets out of Anthropic's rule are
400s naming the field.

The model is a tiny Qwen3-MoE whose output is fixed (``forced.py``) and, once it opens
``<think>``, loops ``step again`` forever: only the budget ends the thought. After
``</think>`` and the blank line that closes it, it answers ``Hello``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from tests.server import forced
from tests.server.conftest import Server
from tests.server.live import ASK, clients, serve

BUDGET = 1024
LOOP = {" again": "step", "</think>": "\n\n", "\n\n": "Hello", "Hello": "<|im_end|>"}
# Qwen3's switch: thinking off, the prompt holds an empty thought; a past turn's reasoning is
# rendered in its <think> block.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% if not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
ON = {"type": "enabled", "budget_tokens": BUDGET}
# the budget less the <think> token: 1023 words
THOUGHT = "step again" * ((BUDGET - 1) // 2) + "step"


@pytest.fixture(scope="module")
def looping(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("forced")
    model = forced.qwen3_moe(d / "qwen3_moe", ["<think>", "step", " again"], TEMPLATE,
                             loop=LOOP, max_position=2048)
    server = serve(model, d / "serve.log", "--max-seq-len", "2048", "--kv-tokens", "8192")
    yield server
    server.stop()


def blocks(message: Any) -> list[tuple[str, str]]:
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def test_the_budget_closes_the_thought_and_the_answer_follows(looping):
    _, anth = clients(looping)
    # without a budget the thought runs on to max_tokens
    free = anth.messages.create(model="m", max_tokens=40, messages=ASK,
                                thinking={"type": "adaptive"})
    assert free.stop_reason == "max_tokens" and [b.type for b in free.content] == ["thinking"]
    reply = anth.messages.create(model="m", max_tokens=BUDGET + 100, messages=ASK, thinking=ON)
    assert blocks(reply) == [("thinking", THOUGHT), ("text", "Hello")]
    assert reply.stop_reason == "end_turn"
    # the budget's tokens, </think> and the blank line forced, Hello and the end of turn
    assert reply.usage.output_tokens == BUDGET + 2 + 2
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == \
        free.usage.input_tokens + (free.usage.cache_read_input_tokens or 0)
    with anth.messages.stream(model="m", max_tokens=BUDGET + 100, messages=ASK,
                              thinking=ON) as s:
        streamed = s.get_final_message()
    assert blocks(streamed) == blocks(reply)
    assert streamed.content[0].signature == reply.content[0].signature != ""
    assert streamed.usage.output_tokens == reply.usage.output_tokens
    # max_tokens counts the thought: a limit just past the budget cuts the forced closer
    cut = anth.messages.create(model="m", max_tokens=BUDGET + 1, messages=ASK, thinking=ON)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == BUDGET + 1


def test_disabled_thinking_renders_the_template_without_a_thought(looping):
    _, anth = clients(looping)
    adaptive = anth.messages.count_tokens(model="m", messages=ASK,
                                          thinking={"type": "adaptive"}).input_tokens
    off = anth.messages.count_tokens(model="m", messages=ASK,
                                     thinking={"type": "disabled"}).input_tokens
    assert off == adaptive + 4  # <think>, \n\n, </think>, \n\n
    reply = anth.messages.create(model="m", max_tokens=16, messages=ASK,
                                 thinking={"type": "disabled"})
    assert blocks(reply) == [("text", "Hello")] and reply.stop_reason == "end_turn"


def test_a_thinking_block_sent_back_is_checked_against_its_signature(looping):
    _, anth = clients(looping)
    reply = anth.messages.create(model="m", max_tokens=BUDGET + 100, messages=ASK, thinking=ON)
    thought, answer = reply.content

    def later(block: dict[str, Any]) -> list[dict[str, Any]]:
        return [*ASK, {"role": "assistant", "content": [block, {"type": "text",
                                                                "text": answer.text}]},
                {"role": "user", "content": "and then?"}]

    signed = {"type": "thinking", "thinking": thought.thinking, "signature": thought.signature}
    without = anth.messages.count_tokens(
        model="m", messages=[*ASK, {"role": "assistant", "content": answer.text},
                             {"role": "user", "content": "and then?"}]).input_tokens
    # accepted, and rendered into the prompt as the turn's reasoning
    assert anth.messages.count_tokens(model="m", messages=later(signed)).input_tokens == \
        without + 1 + (BUDGET - 1) + 2  # <think>, the words, </think> and \n\n
    again = anth.messages.create(model="m", max_tokens=16, messages=later(signed))
    assert blocks(again) == [("text", "Hello")]
    for wrong in ({**signed, "thinking": thought.thinking + " edited"},
                  {**signed, "signature": thought.signature[:-2] + "xx"},
                  {"type": "thinking", "thinking": thought.thinking, "signature": ""}):
        with pytest.raises(anthropic.BadRequestError) as e:
            anth.messages.create(model="m", max_tokens=16, messages=later(wrong))
        assert e.value.body["error"]["message"].startswith("messages.1.content.0.signature: ")
        with pytest.raises(anthropic.BadRequestError):
            anth.messages.count_tokens(model="m", messages=later(wrong))
    assert anth.messages.create(model="m", max_tokens=16, messages=ASK).stop_reason


@pytest.mark.parametrize("thinking, max_tokens, says", [
    ({"type": "enabled", "budget_tokens": 1023}, 2000, "below the minimum of 1024"),
    ({"type": "enabled", "budget_tokens": 1024}, 1024, "less than max_tokens"),
    ({"type": "enabled"}, 2000, "required"),
    ({"type": "disabled", "budget_tokens": 1024}, 2000, "only thinking.type 'enabled'"),
])
def test_a_budget_out_of_the_rule_is_a_400_naming_it(looping, thinking, max_tokens, says):
    r = httpx.post(f"{looping.url}/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": max_tokens, "messages": ASK, "thinking": thinking})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("thinking.budget_tokens: ")
    assert says in err["error"]["message"]
