"""Activations by their checkpoint names.

An expert computes ``down(glu(gate(x), up(x)))``. For most models ``glu(g, u) = act(g) * u``
with a unary ``act`` from :data:`ACTIVATIONS`; GPT-OSS's experts use
:class:`ClampedSwiGLU` (``swiglu_oai``), whose own :meth:`ClampedSwiGLU.glu` clamps both
halves. :func:`glu` applies either.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class ClampedSwiGLU:
    """GPT-OSS: g' = min(g, limit), u' = clamp(u, -limit, limit),
    glu = (u' + 1) * g' * sigmoid(alpha * g')."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, g: torch.Tensor) -> torch.Tensor:
        g = g.clamp(max=self.limit)
        return g * torch.sigmoid(g * self.alpha)

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (u.clamp(-self.limit, self.limit) + 1) * self(g)


def expert_activation(name: str, alpha: float = 0.0, limit: float = 0.0) -> Any:
    """The experts' activation by name: one of :data:`ACTIVATIONS`, or ``swiglu_oai``."""
    if name == "swiglu_oai":
        return ClampedSwiGLU(alpha, limit)
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r} (choose from "
                         f"{', '.join([*ACTIVATIONS, 'swiglu_oai'])})")
    return ACTIVATIONS[name]


def glu(act: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``act(g) * u``, or the activation's own gated form where it has one."""
    own = getattr(act, "glu", None)
    return own(g, u) if own is not None else act(g) * u
