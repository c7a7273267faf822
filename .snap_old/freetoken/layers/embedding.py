"""Token embedding, optionally scaled (Gemma multiplies by sqrt(hidden) in the weight dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.weight)
        if self.scale != 1.0:
            h = h * torch.tensor(self.scale, dtype=h.dtype)
        return h
