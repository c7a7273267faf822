"""Look-ahead: the next MoE layer's router applied to this layer's expert input predicts the
experts the next layer will route to, and their misses are fetched into the cache while this
layer computes, so the link works during the GPU's own time.

The residual stream changes little from one layer to the next (each layer adds one attention
and one MoE branch to it), so ``router_{L+1}(x_L)``, with ``x_L`` the normalised hidden state
layer L's experts get, picks most of the experts ``router_{L+1}(x_{L+1})`` picks (a router
that normalises and scales its own input, Gemma-4's, is first written as a linear map of
``x_L``: :func:`router_map`). A prediction only moves experts into cache slots earlier: the
next layer finds them as hits, with the same bytes it would have fetched, so outputs do not
change (offload gives the same bits with or without it); a wrong prediction costs link time
and a slot.

Per prediction the next layer's call scores it: ``lookahead_needed`` experts it routed to,
``lookahead_used`` of them predicted (the hit rate of the prediction is used / needed),
``lookahead_predicted`` predicted in all, ``prefetched`` the predicted misses copied.

Threads: the engine's main thread only (as the expert cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from freetoken.cpu.abi import IN_FETCHED, IN_LISTS, IN_PREDICTED
from freetoken.cpu.gpu_wait import to_host

PREFETCH_PER_TOKEN = 1.0  # predicted misses fetched per call at most: this x top_k x tokens
PREDICT_MAX_TOKENS = 16  # calls of more tokens (prefill chunks) predict nothing


class Incoming:
    """What the layer before's look-ahead did for a layer's next call: the experts it
    predicted and those of them it fetched, in one int64 array that the library's plan of a
    call reads and writes too (``csrc/layer_call.h`` IncomingAt: the two counts, then the two
    lists), so either plan, Python or the library's, scores what either predicted. A plain
    object: the engine thread writes it every call, which an nn.Module attribute makes slow."""

    def __init__(self, experts: int) -> None:
        self.experts = experts
        self.buf = np.zeros(IN_LISTS + 2 * experts, dtype=np.int64)
        self.buf[IN_PREDICTED] = -1
        self.arrived = 0  # experts of the last call that it had fetched (the Python plan's)

    @property
    def address(self) -> int:
        return int(self.buf.ctypes.data)

    @property
    def pending(self) -> bool:
        """Whether a prediction waits to be scored (or fetched experts to be counted)."""
        return bool(self.buf[IN_PREDICTED] >= 0 or self.buf[IN_FETCHED] > 0)

    @property
    def predicted(self) -> set[int] | None:
        """The experts it predicted (None: no prediction)."""
        n = int(self.buf[IN_PREDICTED])
        return None if n < 0 else set(self.buf[IN_LISTS:IN_LISTS + n].tolist())

    @property
    def prefetched(self) -> set[int]:
        """Of those, the misses it fetched."""
        at = IN_LISTS + self.experts
        return set(self.buf[at:at + int(self.buf[IN_FETCHED])].tolist())

    def put(self, predicted: np.ndarray, fetched: np.ndarray) -> None:
        """A prediction made (as the library's look-ahead writes it)."""
        buf, at = self.buf, IN_LISTS + self.experts
        buf[IN_PREDICTED], buf[IN_FETCHED] = predicted.size, fetched.size
        buf[IN_LISTS:IN_LISTS + predicted.size] = predicted
        buf[at:at + fetched.size] = fetched

    def clear(self) -> None:
        """Read by the call it was for (what was fetched stays in the cache)."""
        self.buf[IN_PREDICTED], self.buf[IN_FETCHED] = -1, 0


@dataclass(frozen=True)
class AheadRule:
    """How many of a call's predicted misses look-ahead fetches for the next layer (the
    library's twin: ``csrc/layer_call.h`` ahead_count): max(round(share m), round(floor m)),
    at most ``max_fetch`` (None: no cap). Offload: every one; hybrid: its split's share, or
    its look-ahead share where that is more (:meth:`HybridExperts.prefetch_rule`)."""

    share: float
    floor: float = 0.0
    max_fetch: int | None = None

    def count(self, misses: int) -> int:
        n = max(round(self.share * misses), round(self.floor * misses))
        return n if self.max_fetch is None else min(n, self.max_fetch)

    def write(self, into: Any, budget: int) -> None:
        """This rule and a call's ``budget`` into the library's AheadRule."""
        into.share, into.floor, into.budget = self.share, self.floor, budget
        into.max_fetch = -1 if self.max_fetch is None else self.max_fetch


EVERY = AheadRule(1.0)  # every predicted miss
NONE = AheadRule(0.0)  # none: no look-ahead for the call


@dataclass
class Lookahead:
    """Layer ``layer``'s router (weight (E, H) and bias, float32 on the model's device) for
    the layer before it to predict with, and ``target``: that layer's experts (their bank and
    cache), which say how many of the predicted misses to fetch (``prefetch_rule``: offload
    all of them, hybrid a share).

    The router runs where the model does (:meth:`route`: device ops, inside a decode graph's
    piece), so the host gets only its picks, with the routed ids, and the expert cache ranks
    them (:meth:`~freetoken.moe.slot_pool.SlotPool.prefetch`)."""

    layer: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    top_k: int
    target: Any  # the next layer's OffloadExperts (a plain reference, not a submodule)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """The next layer's router on the tokens ``x`` (T, H): its top-k experts per token,
        (T, k) int64 on x's device."""
        logits = torch.nn.functional.linear(x.float(), self.weight, self.bias)
        return torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).indices

    def wanted(self, tokens: int, rule: AheadRule) -> int:
        """:meth:`budget` for a call of ``tokens``, or 0 while the target takes no predictions
        (``rule``, its :meth:`prefetch_rule`, fetches none of them: a hybrid layer before its
        split has a share, or while it computes every expert on the CPU): then nothing is
        ranked or fetched."""
        budget = self.budget(tokens)
        return budget if budget and rule.count(budget) else 0

    def fetch(self, rt: Any, x: torch.Tensor, keep: np.ndarray, picks: torch.Tensor | None,
              budget: int, rule: AheadRule) -> None:
        """The experts the target's router picks for the tokens ``x`` fetched into the cache
        now, on ``rt``'s copy stream behind the calling layer's copies, into slots other than
        ``keep`` (the calling layer's, which its compute still reads), as many as the target's
        ``rule`` gives of its predicted misses (``budget`` at most: :meth:`wanted`). ``picks``:
        made in the graph piece before (with the host's copies); None: routed here (on a GPU
        the host has synced on the routed ids already). The library's plan of a call does the
        same in its own code (``csrc/layer_call.cpp`` look_ahead)."""
        if picks is None:
            picks = to_host(self.route(x))
        pool = rt.cache.pool(self.layer)
        target = self.target
        got = pool.prefetch(self.layer, picks, keep, lambda misses: min(rule.count(misses),
                                                                          budget))
        target.incoming.put(got.predicted, got.fetched)
        if not got.fetched.size:
            return
        bank = target.bank
        span = rt.fetch(pool.data, got.slots, bank, got.fetched, wait=False)
        rt.stats.record_prefetch(self.layer, got.fetched.size,
                                 got.fetched.size * bank.expert_bytes, span)

    def budget(self, tokens: int) -> int:
        """Predicted misses fetched for a call of ``tokens`` at most (0: too many tokens to
        predict for: a prefill chunk streams its experts anyway)."""
        if tokens > PREDICT_MAX_TOKENS:
            return 0
        return int(PREFETCH_PER_TOKEN * self.top_k * tokens)


def router_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The router of an MoE block when it is a plain linear layer, logits = x W^T (+ b):
    ``gate`` in Qwen3-MoE and the moeified families, ``router`` in GPT-OSS; None otherwise."""
    experts = block.experts.shape.num_experts
    for name in ("gate", "router"):
        r = getattr(block, name, None)
        w = getattr(r, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == experts:
            return r
    return None


Map = tuple[torch.Tensor, torch.Tensor | None]  # logits = x W^T (+ b)


def router_map(block: torch.nn.Module, before: torch.nn.Module) -> Map | None:
    """``block``'s router logits as a linear map of the experts' input of ``before`` (the MoE
    block one MoE layer earlier): a plain linear router reads that input as it is; a family
    whose router normalises and scales its own input (Gemma-4) says how through the block's
    ``router_map(before)``; None where there is no such map."""
    own = getattr(block, "router_map", None)
    if callable(own):
        return own(before)
    r = router_of(block)
    return None if r is None else (r.weight, r.bias)


def link(model: torch.nn.Module, eligible: Callable[[torch.nn.Module], bool]) -> int:
    """Give every ``eligible`` experts layer whose next MoE layer is eligible too (same model,
    so the same expert cache) a :class:`Lookahead` on that layer's router; returns how
    many."""
    n = 0
    for this, nxt, router in next_routers(model):
        if not (eligible(this) and eligible(nxt)):
            continue
        this.lookahead = on_router(nxt, router)
        n += 1
    return n


def on_router(target: Any, router: Map) -> Lookahead:
    """A :class:`Lookahead` on ``target``'s router map, its weights float32 where the router
    is (routers are float32 there, so nothing is copied)."""
    weight, bias = router
    w = weight.detach().float().contiguous()
    b = None if bias is None else bias.detach().float()
    return Lookahead(target.shape.layer, w, b, target.shape.top_k, target)


def next_routers(model: torch.nn.Module) -> list[tuple[Any, Any, Map]]:
    """Each MoE layer's experts with the next MoE layer's experts and router map (on this
    layer's experts' input, :func:`router_map`), in layer order; pairs without a map are
    left out."""
    blocks = [m for m in model.modules()
              if isinstance(getattr(m, "experts", None), torch.nn.Module)]
    blocks.sort(key=lambda m: m.experts.shape.layer)
    return [(this.experts, nxt.experts, router) for this, nxt in pairwise(blocks)
            if (router := router_map(nxt, this)) is not None]
