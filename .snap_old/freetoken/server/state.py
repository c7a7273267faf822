"""What every route of the API process shares, and the finish reasons it gives itself."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from freetoken.engine.scheduler import Event
from freetoken.server.metrics import Metrics
from freetoken.server.process import EngineClient
from freetoken.server.signing import ThinkingSigner

# Finish reasons the API process sets, not the engine: the client went away; the server stopped
# the request at the end of its shutdown grace period.
GONE, SHUTDOWN = "gone", "shutdown"


@dataclass
class ServerState:
    """Owned by the asyncio loop's thread; every method is called there.

    ``parser_family`` names the output parser (``server/parsers``) that splits each chat and
    messages output into reasoning, content and tool calls; ``end_token_ids`` are the
    model's end-of-turn tokens, which never become text even where a parser keeps special
    tokens.
    """

    client: EngineClient
    tokenizer: Any
    model_name: str
    max_len: int
    chat_template: str | None
    max_queued: int
    parser_family: str = "plain"
    end_token_ids: frozenset[int] = frozenset()
    metrics: Metrics = field(default_factory=Metrics)
    signer: ThinkingSigner = field(default_factory=ThinkingSigner)  # thinking blocks' signatures
    started: float = field(default_factory=time.time)
    draining: bool = False  # shutting down: new requests get 503, in-flight ones finish

    def end_all(self, reason: str = SHUTDOWN) -> int:
        """End every request in flight now: each one's generation sees ``reason`` as its finish
        and aborts its engine side. Returns how many there were."""
        queues = list(self.client.queues.items())
        for rid, q in queues:
            q.put_nowait(Event(rid, None, reason, 0, 0, 0))
        return len(queues)
