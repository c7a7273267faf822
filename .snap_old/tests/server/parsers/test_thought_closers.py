"""Each family's thought closer: fed mid-thought, what follows it is the answer; outside a
thought, and in a family without reasoning markup, there is none."""

from __future__ import annotations

import pytest

from freetoken.server.parsers import ContentDelta, ReasoningDelta, make_parser

# family -> (rendered prompt, the start of a thought, the closer expected there)
THOUGHT = {
    "qwen3": ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<think>\nstep one",
              "</think>\n\n"),
    "gpt_oss": ("<|start|>user<|message|>hi<|end|><|start|>assistant",
                "<|channel|>analysis<|message|>step one",
                "<|end|><|start|>assistant<|channel|>final<|message|>"),
    "gemma4": ("<|turn>user\nhi<turn|>\n<|turn>model\n", "<|channel>thought\nstep one",
               "<channel|>"),
}


@pytest.mark.parametrize("family", sorted(THOUGHT))
@pytest.mark.parametrize("cut", [1, 4, 1000])
def test_after_the_closer_the_output_is_the_answer(family, cut):
    prompt, thought, closer = THOUGHT[family]
    parser = make_parser(family, prompt=prompt)
    assert parser.thought_closer() is None  # no thought open yet
    events = parser.feed(thought)
    assert parser.thought_closer() == closer
    for text in (closer, "The answer."):
        events += [e for i in range(0, len(text), cut) for e in parser.feed(text[i:i + cut])]
    assert parser.thought_closer() is None
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert (reasoning, content) == ("step one", "The answer.")


def test_a_thought_the_prompt_opened_is_closed_from_the_start():
    parser = make_parser("qwen3", prompt="<|im_start|>assistant\n<think>\n")
    assert parser.thought_closer() == "</think>\n\n"


@pytest.mark.parametrize("family", ["gemma3", "plain"])
def test_families_without_reasoning_markup_have_no_closer(family):
    parser = make_parser(family)
    parser.feed("<think>\nstep one")
    assert parser.thought_closer() is None
