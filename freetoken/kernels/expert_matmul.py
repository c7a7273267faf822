"""Experts as torch matmuls: the compute paths every strategy shares on the model's device.

:func:`gathered` runs a call's (token, expert) pairs at once from gathered weights;
:func:`grouped` runs expert by expert over the tokens routed to each. The resident strategy
reads the weights from its parameters, offload and hybrid from their cache slots, and the fused
gather-GEMV kernels (:mod:`.gather_gemv`) are tested against :func:`gathered`.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import torch

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
