"""Resident strategy: every expert of the layer on the compute device, stacked per projection."""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers.activation import ACTIVATIONS
from freetoken.moe.strategy import Experts, ExpertShape, register

# On a GPU, up to this many (token, expert) pairs (decode batches of up to 16 at top-8),
# gathering the chosen experts' weights and running batched matmuls beats one small matmul
# chain per expert: kernel launches, not the extra copy, dominate there. On the CPU the
# gather's copy costs more than it saves.
GATHER_MAX_PAIRS = 128


@register("resident")
class ResidentExperts(Experts):
    """gate_proj, up_proj: (E, I, H); down_proj: (E, H, I) — the GGUF stacking."""

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        E, H, I_ = shape.num_experts, shape.hidden, shape.intermediate
        self.shape = shape
        self.act = ACTIVATIONS[shape.activation]
        self.gate_proj = nn.Parameter(torch.empty(E, I_, H), requires_grad=False)
        self.up_proj = nn.Parameter(torch.empty(E, I_, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I_), requires_grad=False)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda and topk_ids.numel() <= GATHER_MAX_PAIRS:
            return self._gathered(x, topk_ids, topk_weights)
        return self._grouped(x, topk_ids, topk_weights)

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        T, A = ids.shape
        flat = ids.reshape(-1)
        h = x.repeat_interleave(A, dim=0).unsqueeze(-1)  # (T*A, H, 1)
        g = torch.bmm(self.gate_proj[flat], h)
        u = torch.bmm(self.up_proj[flat], h)
        y = torch.bmm(self.down_proj[flat], self.act(g) * u).squeeze(-1)  # (T*A, H)
        return (y.view(T, A, -1) * w.unsqueeze(-1).to(y.dtype)).sum(1)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        T, A = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.shape.num_experts).tolist()
        tokens = order // A
        weights = w.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = tokens[start:start + n]
            h = x[tok]
            y = (self.act(h @ self.gate_proj[e].T) * (h @ self.up_proj[e].T)) @ self.down_proj[e].T
            out.index_add_(0, tok, y * weights[start:start + n, None])
            start += n
        return out


def reference_experts(
    experts: ResidentExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Slow twin: one (token, expert) pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            h = x[t].float()
            g = experts.gate_proj[e].float() @ h
            u = experts.up_proj[e].float() @ h
            out[t] += float(w[t, a]) * (experts.down_proj[e].float() @ (experts.act(g) * u))
    return out
