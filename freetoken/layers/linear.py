"""A linear layer (bias-free unless asked) whose weight is loaded from any registered format.

The weight is dequantised once at load into the compute dtype (the resident path); formats
that are computed in place (the CPU expert kernels) live in ``freetoken/moe``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ W^T (+ b)`` with W of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
