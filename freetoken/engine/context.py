"""Per-forward state, passed explicitly through the model (never held in globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freetoken.kvcache.contiguous import ContiguousKV


@dataclass(frozen=True)
class ForwardContext:
    """One forward over T new tokens of one sequence.

    ``positions`` (T,) are absolute and contiguous; ``end`` = positions[-1] + 1 is how many
    cached positions attention reads.
    """

    positions: torch.Tensor
    kv: ContiguousKV
    start: int
    end: int

    @staticmethod
    def for_tokens(
        kv: ContiguousKV, start: int, count: int, device: torch.device
    ) -> ForwardContext:
        positions = torch.arange(start, start + count, device=device)
        return ForwardContext(positions, kv, start, start + count)
