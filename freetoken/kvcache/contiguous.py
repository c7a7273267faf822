"""A contiguous KV cache for one sequence: per layer a (max_len, kv_heads, head_dim) buffer."""

from __future__ import annotations

import torch


class ContiguousKV:
    """Keys and values of one sequence. Positions are absolute token indices from 0."""

    def __init__(
        self, num_layers: int, max_len: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (num_layers, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def store(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (T, kv_heads, head_dim) at ``positions``; return views of 0..end."""
        self.k[layer, positions] = k
        self.v[layer, positions] = v
        return self.k[layer, :end], self.v[layer, :end]
