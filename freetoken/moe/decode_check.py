"""The decode check's record: offload and the strategies that use the CPU (hybrid, cpu), each
decoding the model itself on the box, as ``ft bench bw --decode-check`` measured them
(:mod:`freetoken.bench.decode_run`). The row's GB/s cannot see what decides some boxes:
offload's look-ahead fetches the next layer's experts while the GPU computes this one, so a
model whose GPU step is long hides its link there, and a CPU share then only adds its wait
(on an H100, the 30-layer nvfp4 Gemma-4 file decoded 65.9 tok/s offloaded against hybrid's
60.1, where its row recommends hybrid); and with its jobs inside the decode graph the cpu
strategy decoded the 48-layer qwen3-30b-a3b q8_0 file at 51.7 tok/s where hybrid, which its
row recommends, made 36.5-43.3. ``--moe-strategy auto`` runs a kind as whichever its check
measured fastest at the run's expert cache.

Threads: any (a frozen record).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from freetoken.config import CacheSizing, human_bytes


@dataclass(frozen=True)
class DecodeCheck:
    """Decode tokens a second per strategy, measured on ``model`` with a ``cache_bytes``
    expert cache (``--moe-cache-mem``), ``tokens`` tokens at temperature 1."""

    model: str
    cache_bytes: int
    tokens: int
    tokens_per_s: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cache_bytes, int) or self.cache_bytes <= 0:
            raise ValueError(f"cache_bytes must be a positive integer, got {self.cache_bytes!r}")
        if "offload" not in self.tokens_per_s:
            raise ValueError("tokens_per_s needs offload's figure, the one others are held to")
        for name, v in self.tokens_per_s.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise ValueError(f"tokens_per_s[{name!r}] must be positive, got {v!r}")

    def applies(self, cache: CacheSizing) -> bool:
        """Whether the check was made at this run's expert cache (the same ``mem`` bytes,
        within 1 %): the hit rate, and so the misses each side takes, follow the cache."""
        return cache.kind == "mem" and abs(cache.value - self.cache_bytes) <= 0.01 * cache.value

    def loses(self, strategy: str) -> bool:
        """Whether ``strategy`` decoded slower than offload (False when it was not run)."""
        t = self.tokens_per_s.get(strategy)
        return t is not None and t < self.tokens_per_s["offload"]

    def fastest(self) -> str:
        """The strategy that decoded fastest (offload where it ties)."""
        return max(["offload", *sorted(set(self.tokens_per_s) - {"offload"})],
                   key=lambda k: self.tokens_per_s[k])

    def words(self) -> str:
        """``offload 65.9, hybrid 60.1 tok/s``: offload first, the rest by name."""
        names = ["offload", *sorted(set(self.tokens_per_s) - {"offload"})]
        return ", ".join(f"{k} {self.tokens_per_s[k]:.1f}" for k in names) + " tok/s"

    def measured(self) -> str:
        """``decode check on this box (M, 4GB) measured offload 65.9, hybrid 60.1 tok/s``."""
        return (f"decode check on this box ({self.model}, {human_bytes(self.cache_bytes)}) "
                f"measured {self.words()}")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "cache_bytes": self.cache_bytes, "tokens": self.tokens,
                "tokens_per_s": dict(self.tokens_per_s)}

    @staticmethod
    def from_json(obj: Any) -> DecodeCheck:
        """A record from its JSON object; ValueError says what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError(f"a decode check must be an object, got {type(obj).__name__}")
        missing = [k for k in ("model", "cache_bytes", "tokens", "tokens_per_s") if k not in obj]
        if missing:
            raise ValueError(f"decode check: missing {', '.join(missing)}")
        if not isinstance(obj["tokens_per_s"], dict):
            raise ValueError("decode check: tokens_per_s must be an object")
        return DecodeCheck(str(obj["model"]), obj["cache_bytes"], obj["tokens"],
                           dict(obj["tokens_per_s"]))
