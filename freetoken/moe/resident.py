"""Resident strategy: every expert of the layer on the compute device, stacked per projection.

Its two compute paths (``kernels/expert_matmul.py``) are shared with the offload strategy,
which runs them on weights that come from its cache slots: same kernels, same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.kernels.activation import expert_activation, glu
from freetoken.kernels.expert_matmul import gathered, grouped, use_gather
from freetoken.moe.strategy import Experts, ExpertShape


class ResidentExperts(Experts):
    """gate_proj, up_proj: (E, I, H); down_proj: (E, H, I) — the GGUF stacking."""

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        E, H, I_ = shape.num_experts, shape.hidden, shape.intermediate
        self.shape = shape
        self.act = expert_activation(shape.activation, shape.swiglu_alpha, shape.swiglu_limit)
        self.make_bias()
        self.gate_proj = nn.Parameter(torch.empty(E, I_, H), requires_grad=False)
        self.up_proj = nn.Parameter(torch.empty(E, I_, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I_), requires_grad=False)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if use_gather(x, topk_ids):
            flat = topk_ids.reshape(-1)
            bias = self.bias()
            return gathered(x, topk_weights, self.gate_proj[flat], self.up_proj[flat],
                            self.down_proj[flat], self.act, bias and bias.rows(flat))
        return grouped(x, topk_ids, topk_weights, self.shape.num_experts, self._weights,
                       self.act, bias=self.bias())

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj[e], self.up_proj[e], self.down_proj[e]


def reference_experts(
    experts: ResidentExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """Slow twin: one (token, expert) pair at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    b = experts.bias()
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            h = x[t].float()
            g = experts.gate_proj[e].float() @ h
            u = experts.up_proj[e].float() @ h
            if b is not None:
                g, u = g + b.gate[e].float(), u + b.up[e].float()
            y = experts.down_proj[e].float() @ glu(experts.act, g, u)
            if b is not None:
                y = y + b.down[e].float()
            out[t] += float(w[t, a]) * y
    return out
