"""Warm reads for the cpu strategy on a GPU: while the GPU runs the next layer's attention and
router, the CPU pool would wait, and the memory would sit idle; instead the pool reads the
experts that layer will probably route to into the CPU's last-level cache
(:meth:`~freetoken.cpu.executor.CpuMoeExecutor.warm`), so its job reads them from there.

The prediction is look-ahead's (``moe/lookahead.py``): the next MoE layer's router applied to
this layer's expert input. It runs on the engine thread while the pool computes this layer's
job; the read is queued behind that job (the pool runs jobs in order, so workers start it as
the job's items run out), and the next layer's job cancels what is left of it. A wrong
prediction costs memory time the pool had spare; outputs never change.

Per call the next layer scores the prediction: ``warmed`` experts read ahead, ``warm_used``
of them routed to by the call that followed.

Threads: the engine's main thread only.
"""

from __future__ import annotations

from typing import Any

import torch

from freetoken.moe.lookahead import PREDICT_MAX_TOKENS, Lookahead, next_routers, on_router


def predict(ahead: Lookahead, x: torch.Tensor, most: int) -> torch.Tensor | None:
    """The next layer's experts for the host tokens ``x`` (T, H) float32, by ``ahead``'s router
    (its weights on the host): each token's top-k, first choices first, then second, and so
    on, each expert once, ``most`` at most; int32. None for more than ``PREDICT_MAX_TOKENS``
    tokens (a prompt's chunk reads most experts anyway)."""
    if x.shape[0] > PREDICT_MAX_TOKENS:
        return None
    order = dict.fromkeys(ahead.route(x).t().reshape(-1).tolist())
    return torch.tensor(list(order)[:most], dtype=torch.int32)


def link(model: torch.nn.Module, eligible: Any) -> int:
    """Give every ``eligible`` experts layer (the cpu strategy's, on a GPU) whose next MoE
    layer is eligible too a :class:`~freetoken.moe.lookahead.Lookahead` on that layer's
    router map, on the host (``warm_next``); returns how many."""
    n = 0
    for this, nxt, router in next_routers(model):
        if eligible(this) and eligible(nxt):
            this.warm_next = on_router(nxt, router, device="cpu")
            n += 1
    return n
