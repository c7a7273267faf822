"""Resident strategy: every expert of the layer on the compute device, stacked per projection.

The two compute paths (:func:`gathered`, :func:`grouped`) are shared with the offload strategy,
which runs them on weights that come from its cache slots: same kernels, same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import torch
from torch import nn

from freetoken.layers.activation import ACTIVATIONS
from freetoken.moe.strategy import Experts, ExpertShape, register

# On a GPU, up to this many (token, expert) pairs (decode batches of up to 16 at top-8),
# gathering the chosen experts' weights and running batched matmuls beats one small matmul
# chain per expert: kernel launches, not the extra copy, dominate there. On the CPU the
# gather's copy costs more than it saves.
GATHER_MAX_PAIRS = 128

Act = Callable[[torch.Tensor], torch.Tensor]
# expert id -> its (gate (I, H), up (I, H), down (H, I)) weights in the compute dtype
WeightsOf = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def use_gather(x: torch.Tensor, ids: torch.Tensor) -> bool:
    return x.is_cuda and ids.numel() <= GATHER_MAX_PAIRS


def gathered(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor, act: Act) -> torch.Tensor:
    """Pairs at once: gate/up (T*A, I, H) and down (T*A, H, I) hold pair p's expert weights,
    pairs token-major; w (T, A). Returns (T, H)."""
    A = w.shape[1]
    h = x.repeat_interleave(A, dim=0).unsqueeze(-1)  # (T*A, H, 1)
    g = torch.bmm(gate, h)
    u = torch.bmm(up, h)
    y = torch.bmm(down, act(g) * u).squeeze(-1)  # (T*A, H)
    return weigh_pairs(y, w)


def weigh_pairs(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Pair outputs y (T*A, H), pairs token-major, weighted by w (T, A) and summed per token."""
    T, A = w.shape
    return (y.view(T, A, -1) * w.unsqueeze(-1).to(y.dtype)).sum(1)


def grouped(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, num_experts: int,
            weights_of: WeightsOf, act: Act, only: Container[int] | None = None) -> torch.Tensor:
    """Expert by expert in ascending id order, each over the tokens routed to it; with
    ``only``, the experts in it alone."""
    T, A = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // A
    weights = w.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        if only is not None and e not in only:
            start += n
            continue
        tok = tokens[start:start + n]
        gate, up, down = weights_of(e)
        h = x[tok]
        y = (act(h @ gate.T) * (h @ up.T)) @ down.T
        out.index_add_(0, tok, y * weights[start:start + n, None])
        start += n
    return out


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
        if use_gather(x, topk_ids):
            flat = topk_ids.reshape(-1)
            return gathered(x, topk_weights, self.gate_proj[flat], self.up_proj[flat],
                            self.down_proj[flat], self.act)
        return grouped(x, topk_ids, topk_weights, self.shape.num_experts, self._weights,
                       self.act)

    def _weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.gate_proj[e], self.up_proj[e], self.down_proj[e]


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
