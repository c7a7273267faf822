"""Recorded outputs of each family, written from its documented format, with what they mean.

Shared by the per-family checks and the streaming checks: every case is parsed whole and cut
into deltas every way, and both must give its expected meaning.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

Q = '<|"|>'


@dataclass(frozen=True)
class Case:
    id: str
    family: str
    text: str
    content: str
    reasoning: str = ""
    calls: tuple[tuple[str, dict], ...] = ()
    malformed: bool = False
    prompt: str = ""


def counter() -> Callable[[], str]:
    """Tool-call ids call_0, call_1, ... so that two parses compare equal."""
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def _qcall(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


WEATHER = {"city": "Paris", "days": 3}
NESTED = {"filter": {"any": [{"tag": "a}b"}, {"tag": "{"}]}, "q": "say \"</tool_call>\" {x}"}
UNICODE = {"text": "naïve café — 東京", "emoji": "🙂"}

CASES = [
    Case("qwen3-think-answer", "qwen3", "<think>\nThe user greets.\n</think>\n\nHello there!",
         "Hello there!", "The user greets."),
    Case("qwen3-think-call", "qwen3",
         "<think>\nNeed weather.\n</think>\n\n" + _qcall("get_weather", WEATHER),
         "", "Need weather.", (("get_weather", WEATHER),)),
    Case("qwen3-two-calls-text-after", "qwen3",
         "Checking both.\n" + _qcall("a", {"x": 1}) + "\n" + _qcall("b", {}) + "\nDone.",
         "Checking both.\nDone.", "", (("a", {"x": 1}), ("b", {}))),
    Case("qwen3-nested-braces-and-closer-in-string", "qwen3", _qcall("search", NESTED),
         "", "", (("search", NESTED),)),
    Case("qwen3-unicode", "qwen3", _qcall("say", UNICODE) + "<|im_end|>", "", "",
         (("say", UNICODE),)),
    Case("qwen3-prompt-opened-think", "qwen3", "Short plan.\n</think>\n\nAnswer.", "Answer.",
         "Short plan.", prompt="<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    Case("qwen3-prompt-closed-think", "qwen3", "Just the answer <b>bold</b> a<b",
         "Just the answer <b>bold</b> a<b",
         prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    Case("qwen3-reasoning-only", "qwen3", "<think>\nStill thinking when cut off", "",
         "Still thinking when cut off"),
    Case("qwen3-broken-json", "qwen3",
         'Try.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
         'Try.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', malformed=True),
    Case("qwen3-no-name", "qwen3", '<tool_call>{"arguments": {}}</tool_call>',
         '<tool_call>{"arguments": {}}</tool_call>', malformed=True),
    Case("qwen3-unclosed-call-at-end", "qwen3", '<tool_call>\n{"name": "f", "arguments": {}}',
         "", "", (("f", {}),)),
    Case("qwen3-string-arguments", "qwen3",
         '<tool_call>{"name": "f", "arguments": "{\\"k\\": [1, 2]}"}</tool_call>', "", "",
         (("f", {"k": [1, 2]}),)),
    Case("harmony-analysis-call", "gpt_oss",
         "<|channel|>analysis<|message|>User wants weather; call the tool.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Paris", "days": 3}<|call|>',
         "", "User wants weather; call the tool.", (("get_weather", WEATHER),)),
    Case("harmony-analysis-final", "gpt_oss",
         "<|channel|>analysis<|message|>Simple greeting.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hi! How can I help?<|return|>",
         "Hi! How can I help?", "Simple greeting."),
    Case("harmony-preamble-recipient-in-role-closer-in-string", "gpt_oss",
         "<|channel|>analysis<|message|>Two steps.<|end|>"
         "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
         "<|start|>assistant to=functions.search<|channel|>commentary json<|message|>"
         + json.dumps(NESTED | {"t": "<|call|>"}) + "<|call|>",
         "Looking it up.", "Two steps.", (("search", NESTED | {"t": "<|call|>"}),)),
    Case("harmony-call-without-closer", "gpt_oss",
         '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": [1]}',
         "", "", (("f", {"a": [1]}),)),
    Case("harmony-final-after-call-result", "gpt_oss",
         "<|channel|>final<|message|>It is 20 °C in Paris.",
         "It is 20 °C in Paris.",
         prompt="<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                '{"c": 20}<|end|><|start|>assistant'),
    Case("harmony-broken-json", "gpt_oss",
         "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{'a': 1}<|call|>",
         "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{'a': 1}<|call|>",
         malformed=True),
    Case("harmony-analysis-only-cut-off", "gpt_oss",
         "<|channel|>analysis<|message|>Still weighing the options", "",
         "Still weighing the options"),
    Case("harmony-text-without-header", "gpt_oss", "No channel <b>at all</b>.",
         "No channel <b>at all</b>."),
    Case("harmony-header-never-closes", "gpt_oss", "<|channel|>final " + "x" * 300,
         "<|channel|>final " + "x" * 300),
    Case("gemma4-thought-call", "gemma4",
         "<|channel>thought\nNeed the weather.<channel|>"
         f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|><|tool_response>",
         "", "Need the weather.", (("get_weather", WEATHER),)),
    Case("gemma4-two-calls-nested-delims", "gemma4",
         f"Sure.<|tool_call>call:a{{q:{Q}x}}<tool_call|>{{{Q},n:[1,-2.5e3,true,null],"
         f"o:{{k:{Q}v{Q}}}}}<tool_call|><|tool_call>call:b{{}}<tool_call|>",
         "Sure.", "", (("a", {"q": "x}<tool_call|>{", "n": [1, -2500.0, True, None],
                              "o": {"k": "v"}}), ("b", {}))),
    Case("gemma4-answer", "gemma4", "The answer is 4.<turn|>", "The answer is 4.",
         prompt="<|turn>user\n2+2?<turn|>\n<|turn>model\n"),
    Case("gemma4-thought-only-cut-off", "gemma4", "<|channel>thought\nStill weighing", "",
         "Still weighing"),
    Case("gemma4-broken", "gemma4", f"<|tool_call>call:f{{a:{Q}x}}<tool_call|>",
         f"<|tool_call>call:f{{a:{Q}x}}<tool_call|>", malformed=True),
    Case("gemma3-tool-code", "gemma3",
         "Let me check.\n```tool_code\nget_weather(city=\"Paris\", days=3)\n```",
         "Let me check.", "", (("get_weather", WEATHER),)),
    Case("gemma3-list-and-fence-in-string", "gemma3",
         "```tool_code\n[a(x='```', y=[1, 2]), b()]\n```\nok<end_of_turn>", "ok", "",
         (("a", {"x": "```", "y": [1, 2]}), ("b", {}))),
    Case("gemma3-python-block-is-text", "gemma3", "```python\nprint(1)\n```",
         "```python\nprint(1)\n```"),
    Case("gemma3-positional-args-malformed", "gemma3", "```tool_code\nf(1)\n```",
         "```tool_code\nf(1)\n```", malformed=True),
    Case("plain-keeps-every-byte", "plain", "  <think>x</think> <tool_call>{}</tool_call>\n",
         "  <think>x</think> <tool_call>{}</tool_call>\n"),
]
