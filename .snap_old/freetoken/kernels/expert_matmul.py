"""Experts as torch matmuls: the compute paths every strategy shares on the model's device.

:func:`gathered` runs a call's (token, expert) pairs at once from gathered weights;
:func:`grouped` runs expert by expert over the tokens routed to each. The resident strategy
reads the weights from its parameters, offload and hybrid from their cache slots, and the fused
gather-GEMV kernels (:mod:`.gather_gemv`) are tested against :func:`gathered`.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

import torch

from freetoken.kernels.activation import glu

# On a GPU, up to this many (token, expert) pairs (decode batches of up to 16 at top-8),
# gathering the chosen experts' weights and running batched matmuls beats one small matmul
# chain per expert: kernel launches, not the extra copy, dominate there. On the CPU the
# gather's copy costs more than it saves.
GATHER_MAX_PAIRS = 128

Act = Callable[[torch.Tensor], torch.Tensor]  # or an activation with its own glu (activation.py)


@dataclass(frozen=True)
class ExpertBias:
    """Biased experts (GPT-OSS): gate/up (N, I) and down (N, H), stacked per expert (N = E) or,
    from :meth:`rows`, per pair."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    def rows(self, ids: torch.Tensor) -> ExpertBias:
        return ExpertBias(self.gate[ids], self.up[ids], self.down[ids])


# one expert's (gate (I, H), up (I, H), down (H, I)) weights in the compute dtype
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
WeightsOf = Callable[[int], Weights]  # by expert id


def use_gather(x: torch.Tensor, ids: torch.Tensor) -> bool:
    return x.is_cuda and ids.numel() <= GATHER_MAX_PAIRS


def gathered(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
             down: torch.Tensor, act: Act, bias: ExpertBias | None = None) -> torch.Tensor:
    """Pairs at once: gate/up (T*A, I, H) and down (T*A, H, I) hold pair p's expert weights,
    pairs token-major; w (T, A); ``bias`` per pair. Returns (T, H)."""
    A = w.shape[1]
    h = x.repeat_interleave(A, dim=0).unsqueeze(-1)  # (T*A, H, 1)
    g = torch.bmm(gate, h)
    u = torch.bmm(up, h)
    if bias is not None:
        g, u = g + bias.gate.unsqueeze(-1), u + bias.up.unsqueeze(-1)
    y = torch.bmm(down, glu(act, g, u)).squeeze(-1)  # (T*A, H)
    if bias is not None:
        y = y + bias.down
    return weigh_pairs(y, w)


def weigh_pairs(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Pair outputs y (T*A, H), pairs token-major, weighted by w (T, A) and summed per token."""
    T, A = w.shape
    return (y.view(T, A, -1) * w.unsqueeze(-1).to(y.dtype)).sum(1)


def grouped(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, num_experts: int,
            weights_of: WeightsOf, act: Act, only: Container[int] | None = None,
            bias: ExpertBias | None = None) -> torch.Tensor:
    """Expert by expert in ascending id order, each over the tokens routed to it; with
    ``only``, the experts in it alone; ``bias`` stacked per expert."""
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
        if bias is None:
            y = glu(act, h @ gate.T, h @ up.T) @ down.T
        else:
            y = glu(act, h @ gate.T + bias.gate[e], h @ up.T + bias.up[e]) @ down.T + bias.down[e]
        out.index_add_(0, tok, y * weights[start:start + n, None])
        start += n
    return out
