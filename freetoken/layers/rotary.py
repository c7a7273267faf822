"""Rotary position embedding, NeoX layout (the two halves of each head rotate together)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from freetoken.cpu.library import optional


def _native() -> Any:
    """The native library's rotary embedding, or None where it is not built (torch runs)."""
    return optional("ft_rotary_neox")


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
        """Rotate ``x`` (T, heads, head_dim) at ``positions`` (T,). Float32 on the CPU is one
        native call (same bits as :meth:`reference`, its slow twin)."""
        cos = self.cos
        if x.dtype is torch.float32 and x.is_cpu and cos.dtype is torch.float32 and cos.is_cpu \
                and x.dim() == 3 and x.shape[2] == cos.shape[-1] \
                and positions.numel() == x.shape[0]:
            fn = _native()
            if fn is not None:
                x = x.contiguous()
                pos = positions.long().contiguous()
                y = torch.empty_like(x)
                if fn(x.data_ptr(), cos.data_ptr(), self.sin.data_ptr(), cos.shape[0],
                      pos.data_ptr(), x.shape[0], x.shape[1], x.shape[2], y.data_ptr()) == 0:
                    return y
        return self.reference(x, positions)

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = torch.index_select(self.cos, 0, positions)
        sin = torch.index_select(self.sin, 0, positions)
        if cos.dtype != x.dtype:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
