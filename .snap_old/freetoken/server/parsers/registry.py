"""Which parser reads which model's output: one table of families, one of architecture names.

The family comes from the checkpoint (``config.json``'s ``model_type`` or ``architectures``,
GGUF's ``general.architecture``); a flag may name it instead, for a fine-tune that speaks
another family's format. An architecture we do not know gets the passthrough parser, since
guessing markup would eat text; a flag naming an unknown parser is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ...errors import ConfigError
from .base import OutputParser, new_call_id
from .events import ParsedOutput, collect
from .gemma3 import Gemma3Parser
from .gemma4 import Gemma4Parser
from .harmony import HarmonyParser
from .plain import PlainParser
from .qwen3 import Qwen3Parser

PARSERS: dict[str, type[OutputParser]] = {
    p.name: p for p in (Qwen3Parser, HarmonyParser, Gemma3Parser, Gemma4Parser, PlainParser)
}

# Architecture names with case, ``-``, ``_`` and a trailing ``ForCausalLM`` (or
# ``ForConditionalGeneration``) removed, so "qwen3_moe", "qwen3moe" and "Qwen3MoeForCausalLM"
# are one key.
ARCHITECTURES: dict[str, str] = {
    "qwen2": "qwen3",
    "qwen2moe": "qwen3",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3",
    "qwen3next": "qwen3",
    "gptoss": "gpt_oss",
    "gemma3": "gemma3",
    "gemma3text": "gemma3",
    "gemma4": "gemma4",
    "gemma4text": "gemma4",
}
_SUFFIXES = ("forcausallm", "forconditionalgeneration")


def _key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for suffix in _SUFFIXES:
        key = key.removesuffix(suffix)
    return key


def parser_names() -> list[str]:
    """The names a flag may give, for ``--help`` and error messages."""
    return sorted(PARSERS)


def parser_family(architecture: str | None, override: str | None = None) -> str:
    """The parser for a model: ``override`` when given (a parser name or an architecture name),
    else the family of ``architecture``, else ``plain``."""
    if override is not None:
        if override in PARSERS:
            return override
        family = ARCHITECTURES.get(_key(override))
        if family is None:
            raise ConfigError(f"unknown output parser {override!r} (choose from "
                              f"{', '.join(parser_names())})")
        return family
    return ARCHITECTURES.get(_key(architecture or ""), "plain")


def make_parser(family: str, *, prompt: str = "", tools: bool = True,
                new_id: Callable[[], str] = new_call_id) -> OutputParser:
    """A fresh parser for one output of ``family``, primed with the rendered ``prompt`` (see
    ``OutputParser.prime``). ``tools=False`` keeps tool-call markup as content text."""
    try:
        cls = PARSERS[family]
    except KeyError:
        raise ConfigError(f"unknown output parser {family!r} (choose from "
                          f"{', '.join(parser_names())})") from None
    parser = cls(tools=tools, new_id=new_id)
    parser.prime(prompt)
    return parser


def call_opener(family: str, prompt: str, name: str | None) -> str | None:
    """The text that makes generation after the rendered ``prompt`` the rest of a tool call
    (of ``name``, or of a tool the model picks): ``OutputParser.call_opener`` of the family's
    parser primed with ``prompt``. None: the family has no tool-call format."""
    return make_parser(family, prompt=prompt).call_opener(name)


def parse_text(family: str, text: str, *, prompt: str = "", tools: bool = True,
               new_id: Callable[[], str] = new_call_id) -> ParsedOutput:
    """A whole output parsed by the streaming parser fed once: one code path for both."""
    parser = make_parser(family, prompt=prompt, tools=tools, new_id=new_id)
    events = parser.feed(text) + parser.finish()
    return collect(events, parser.malformed_tool_call)
