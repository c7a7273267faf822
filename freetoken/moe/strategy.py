"""The MoE strategy interface and its registry.

A model's MoE block routes tokens and hands ``(x, topk_ids, topk_weights)`` to its layer's
:class:`Experts`; the strategy decides where the expert weights live (GPU, host banks, a GPU
cache) and how a miss is served. Model files never name a strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from freetoken.errors import ConfigError


@dataclass(frozen=True)
class ExpertShape:
    """One MoE layer's geometry. E experts, H hidden, I intermediate per expert, A active."""

    layer: int
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    activation: str


class Experts(nn.Module):
    """The experts of one MoE layer.

    Invariants: ``forward`` is called from the engine's main thread only; it returns
    ``sum_a w[t, a] * expert_{ids[t, a]}(x[t])`` for every token t, in x's dtype.
    ``load`` receives each projection once (stacked E x out x in) or once per expert.
    """

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:  # x (T, H), ids/weights (T, A) -> (T, H)
        raise NotImplementedError


ExpertsFactory = Callable[[ExpertShape], Experts]
# One strategy for every MoE layer, or one per layer (``--moe-strategy auto`` resolved)
StrategyPlan = str | tuple[str, ...]
STRATEGIES: dict[str, ExpertsFactory] = {}


def register(name: str) -> Callable[[ExpertsFactory], ExpertsFactory]:
    def wrap(factory: ExpertsFactory) -> ExpertsFactory:
        STRATEGIES[name] = factory
        return factory

    return wrap


def strategy_names() -> list[str]:
    """Registered strategy names (importing the modules that register themselves)."""
    import freetoken.moe.cpu  # noqa: F401
    import freetoken.moe.hybrid  # noqa: F401
    import freetoken.moe.offload  # noqa: F401
    import freetoken.moe.resident  # noqa: F401

    return sorted(STRATEGIES)


def make_experts(strategy: str, shape: ExpertShape) -> Experts:
    if strategy not in strategy_names():
        raise ConfigError(
            f"unknown --moe-strategy {strategy!r} (choose from {', '.join(sorted(STRATEGIES))})"
        )
    return STRATEGIES[strategy](shape)
