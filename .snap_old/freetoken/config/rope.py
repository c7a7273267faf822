"""A layer type's rotary embedding, as a checkpoint describes it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rotary embedding, as Hugging Face's ``rope_parameters`` describe it.

    kind: ``default``; ``linear`` (positions / factor); ``proportional`` (Gemma-4: the first
    ``fraction`` of each head's frequency pairs rotate, the rest do not); ``yarn`` (GPT-OSS:
    frequencies blended between extrapolation and interpolation by ``factor`` over the
    correction range of ``beta_fast``..``beta_slow`` rotations, cos/sin scaled by
    ``attention_factor``, 0.1 ln(factor) + 1 unless given).
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    fraction: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position: int = 0
    truncate: bool = True
    attention_factor: float = 0.0  # 0: from factor
