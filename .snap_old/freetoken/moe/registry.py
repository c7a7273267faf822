"""The MoE strategies by name: the table ``--moe-strategy`` is validated against."""

from __future__ import annotations

from freetoken.errors import ConfigError
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.hybrid import HybridExperts
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.resident import ResidentExperts
from freetoken.moe.strategy import Experts, ExpertShape, Needs

AUTO = "auto"  # --moe-strategy auto: resolved per layer by moe/plan.py
STRATEGIES: dict[str, type[Experts]] = {
    "resident": ResidentExperts,
    "offload": OffloadExperts,
    "cpu": CpuExperts,
    "hybrid": HybridExperts,
}


def strategy_names() -> list[str]:
    return sorted(STRATEGIES)


def _check(strategy: str) -> type[Experts]:
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"unknown --moe-strategy {strategy!r} (choose from {', '.join(sorted(STRATEGIES))})"
        )
    return STRATEGIES[strategy]


def needs_of(strategy: str) -> Needs:
    """What ``strategy`` needs; for ``auto``, what any strategy it may pick needs."""
    if strategy == AUTO:
        out = Needs()
        for cls in STRATEGIES.values():
            out = out | cls.NEEDS
        return out
    return _check(strategy).NEEDS


def make_experts(strategy: str, shape: ExpertShape) -> Experts:
    return _check(strategy)(shape)
