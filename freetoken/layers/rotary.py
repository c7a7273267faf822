"""Rotary position embedding, NeoX layout (the two halves of each head rotate together)."""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    """cos/sin tables for positions ``0..max_position`` with base ``theta``.

    ``factor`` > 1 is linear position scaling (positions divided by factor).
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, factor: float = 1.0) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        pos = torch.arange(max_position, dtype=torch.float32) / factor
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (positions, 1, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (T, heads, head_dim) at ``positions`` (T,)."""
        cos = torch.index_select(self.cos, 0, positions)
        sin = torch.index_select(self.sin, 0, positions)
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
