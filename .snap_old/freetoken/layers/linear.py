"""A linear layer (bias-free unless asked) whose weight is loaded from any registered format.

The weight is dequantised once at load into the compute dtype (the resident path); formats
that are computed in place (the CPU expert kernels) live in ``freetoken/moe``. On a GPU,
projections of one input (attention's q, k, v) can share one stacked weight
(:func:`stack_rows`): one launch instead of three at decode.
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


def stacks(weight: torch.Tensor) -> bool:
    """Whether weights on ``weight``'s device are stacked: on a GPU (on the CPU the pool's own
    kernels or three small matmuls serve)."""
    return weight.is_cuda


def stack_rows(linears: list[Linear]) -> torch.Tensor | None:
    """One (sum of out, in) weight whose row blocks become the bias-free GPU ``linears``'
    weights (views: the loader fills them in place), so their product is one matmul
    (``F.linear(x, stacked)``, split by columns after); None, and nothing changed, on the
    CPU or where a layer has a bias or another type."""
    if not linears or any(type(m) is not Linear or m.bias is not None or not stacks(m.weight)
                          for m in linears):
        return None
    w0 = linears[0].weight
    if any(m.weight.shape[1] != w0.shape[1] or m.weight.dtype != w0.dtype for m in linears):
        return None
    stacked = torch.empty(sum(m.weight.shape[0] for m in linears), w0.shape[1], dtype=w0.dtype,
                          device=w0.device)
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(stacked[start:start + rows], requires_grad=False)
        start += rows
    return stacked
