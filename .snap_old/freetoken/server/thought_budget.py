"""A cap on an output's reasoning: Anthropic's ``thinking.budget_tokens``.

``generate`` asks ``after_token`` once per generated token, after the output parser has read
that token's text. Tokens generated while the parser is inside a thought are counted; the
token that spends the budget with the thought still open gets back the ids of the family's
thought closer (``OutputParser.thought_closer``: Qwen3's ``</think>``, harmony's switch to the
final channel, Gemma-4's ``<channel|>``), which ``generate`` forces as the next tokens, so the
answer follows. A family without reasoning markup never counts, so it is never cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.server.parsers import OutputParser


@dataclass
class ThoughtBudget:
    """One output's budget; owned by the request's generation, on the loop's thread."""

    tokens: int
    parser: OutputParser  # the output's parser, fed by the consumer of ``generate``
    encode: Callable[[str], list[int]]  # text -> token ids, special tokens read as such
    spent: int = 0
    closed: bool = False

    def after_token(self) -> list[int] | None:
        """The ids to force next when the token just read spent the budget inside a thought;
        None otherwise (and always, once the budget has closed one)."""
        if self.closed:
            return None
        closer = self.parser.thought_closer()
        if closer is None:
            return None
        self.spent += 1
        if self.spent < self.tokens:
            return None
        self.closed = True
        return self.encode(closer)
