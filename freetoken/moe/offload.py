"""Offload strategy: experts live in host banks, a GPU cache of slots holds the hot ones, a miss
is fetched over PCIe into a victim slot.

Per layer call (T tokens, A active, E experts):
  route (ids, weights) -> the needed experts -> hits run from their slots; misses get the least
  recently used slots and are copied bank row -> slot on the copy stream; the compute stream waits
  for the copies and runs the same kernels as the resident strategy (:mod:`resident`) on weights
  read from the slots, so offload gives resident's bits.
When a call needs more experts than the pool has slots, or misses more than half the layer's
experts (a prefill chunk), the misses are streamed instead (:mod:`.prefill_stream`): copied in
chunks through two staging buffers (the copy of chunk k+1 overlaps the compute of chunk k)
without touching the cache.

Decode-sized calls on a GPU (pairs few enough to gather) are split: the host's plan (routed
ids, hits and misses, copies, the layer's slot table published to the device), the device's
compute (:meth:`OffloadExperts._from_table`, which reads slots through that table and so needs
nothing from the host), then what the plan left running on the host (:meth:`_finish`: hybrid's
CPU share). Decode CUDA graphs (``engine/graph.py``, through :mod:`.pieces`) run the plan and
the finish between pieces and capture the compute; larger calls run between pieces whole. On
``--device cpu`` the same code runs with host memory as the "device" and memcpy as the link.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from freetoken.cpu.abi import FetchRule
from freetoken.cpu.gpu_wait import to_host
from freetoken.kernels.activation import expert_activation
from freetoken.kernels.build import raised_by_triton
from freetoken.kernels.expert_matmul import Weights, grouped, use_gather
from freetoken.kernels.gather_gemv import gathered_fused, gathered_reference
from freetoken.moe.host_banks import PROJECTIONS, BankBuilder, HostBank
from freetoken.moe.host_job import HostJob
from freetoken.moe.host_steps import HostCopies, Prepared
from freetoken.moe.layer_call import STREAMS, LayerCall, LayerCalls, library_plans
from freetoken.moe.lookahead import EVERY, AheadRule, Incoming, Lookahead
from freetoken.moe.native_slot_pool import NativeSlotPool
from freetoken.moe.prefill_stream import streamed_call
from freetoken.moe.runtime import OffloadRuntime
from freetoken.moe.slot_pool import Routed, SlotPool, Split
from freetoken.moe.stats import Span
from freetoken.moe.strategy import Experts, ExpertShape, LayerPlan, Needs, Shared
from freetoken.quant import QuantTensor

log = logging.getLogger(__name__)

STREAM_ABOVE = 0.5  # stream when a call misses more than this fraction of a layer's experts


class OffloadExperts(Experts):
    """One MoE layer's experts in a host bank, computed from cache slots on the model's device."""

    NEEDS = Needs(host_banks=True, device_cache=True)
    PLAN_READS_INPUTS = False  # the plan needs the routed ids on the host, not x or w
    FINISHES_LATE = False  # the plan leaves host work for :meth:`_finish` (graph step after it)

    def __init__(self, shape: ExpertShape) -> None:
        super().__init__()
        self.shape = shape
        self.act = expert_activation(shape.activation, shape.swiglu_alpha, shape.swiglu_limit)
        self.make_bias()
        self.device = torch.empty(0).device  # the device the model is being built on
        self.dtype = torch.get_default_dtype()
        self.builder = BankBuilder(shape.layer, shape.num_experts, shape.hidden,
                                   shape.intermediate)
        self.bank: HostBank | None = None
        self.runtime: OffloadRuntime | None = None
        self._pool_views: dict[str, QuantTensor] = {}
        self.gpu_kernel = "dequant"  # or "fused": set by choose_gpu_kernels
        self.lookahead: Lookahead | None = None  # the next layer's router (moe/lookahead.py)
        self.incoming = Incoming(shape.num_experts)  # what the layer before's look-ahead did
        self.prepared = Prepared()  # what a host step's prepare left for the plan
        self.layer_calls: LayerCalls | None = None  # None: the Python plan runs

    def load_expert_tensor(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """Keep a checkpoint tensor; the bank is built once the layer's last one arrives."""
        self.builder.add(proj, qt, expert)
        if not self.builder.missing():
            self.bank = self.builder.build(pinned=self.device.type == "cuda")
        return True

    def missing_expert_tensors(self) -> list[str]:
        return [] if self.bank is not None else self.builder.missing()

    def recorder(self) -> OffloadRuntime | None:
        return self.runtime

    def attach(self, plan: LayerPlan, shared: Shared) -> None:
        """Serve misses through the model's shared expert cache."""
        if shared.runtime is None:
            raise RuntimeError(f"layer {self.shape.layer}: {plan.strategy} experts need the "
                               "device expert cache, and none was made")
        self.runtime, self._pool_views = shared.runtime, {}
        pool = shared.runtime.cache.pool(self.shape.layer)
        self.layer_calls = (LayerCalls(self._make_call) if library_plans(pool, shared.runtime)
                            else None)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:  # x (T, H), ids/weights (T, A) -> (T, H)
        rt = self._runtime()
        if use_gather(x, topk_ids):  # decode on a GPU: the host plans, the device computes
            return self._gathered_call(rt, x, topk_ids, topk_weights)
        if rt.capture is not None:  # too many pairs to gather: all of it between the pieces
            return rt.capture.split(self, x, topk_ids, topk_weights)
        flat, pool, routed = self._route(topk_ids)
        if self._must_stream(routed.needed.size, routed.misses, pool):
            return self._streamed(x, topk_ids, topk_weights, pool, routed.hits(), routed.missed())
        return self._serve(x, topk_ids, topk_weights, flat, pool, routed)

    def _gathered_call(self, rt: OffloadRuntime, x: torch.Tensor, ids: torch.Tensor,
                       w: torch.Tensor) -> torch.Tensor:
        """Plan, device compute from the slot table, then what the plan left running on the
        host (:meth:`_finish`). While decode graphs are captured, the plan and the finish run
        between pieces and their results come from static buffers."""
        if rt.capture is not None:
            la = self.lookahead  # the next layer's picks made in the piece, for look-ahead
            picks = la.route(x) if la is not None and la.budget(x.shape[0]) else None
            if rt.capture.fetching:  # a step that fetches every miss: offload's one step
                static = rt.capture.host(self._plan_fetching, x, ids, w, False, picks)
                return self._from_table(x, ids, w) + static
            static = rt.capture.host(self._plan, x, ids, w, self.PLAN_READS_INPUTS, picks,
                                     self._prepare)
            out = self._from_table(x, ids, w) + static
            if self.FINISHES_LATE:
                out = out + rt.capture.after(self._finish, x)
            return out
        early = self._plan(x, ids, w)
        out = self._from_table(x, ids, w)
        late = self._finish()
        for extra in (early, late):
            if extra is not None:
                out = out + extra
        return out

    def _finish(self) -> torch.Tensor | None:
        """The result of what the last :meth:`_plan` left running (nothing here; hybrid's CPU
        share), called once the device's compute is queued."""
        return None

    def _plan_fetching(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                       host: HostCopies) -> torch.Tensor | None:
        """The plan of a call that fetches every miss, between the pieces of a decode graph
        made for such steps (``host`` holds the routed ids, not x or w): nothing is left
        running, so no step follows the device's compute."""
        return self._plan(x, ids, w, host)

    def fetches_next_step(self) -> bool:
        """Whether this layer's call in the next decode step fetches every miss, so that the
        step may run in graphs made for that (hybrid: while its split is all-fetch)."""
        return True

    def _route(self, ids: torch.Tensor) -> tuple[torch.Tensor, SlotPool, Routed]:
        """The routed ids on the host (int64, flat; a sync if they are on the device), and the
        experts they need with their hits and misses (:meth:`SlotPool.route`)."""
        assert self.runtime is not None
        pool = self.runtime.cache.pool(self.shape.layer)
        flat = ids.reshape(-1)
        if flat.is_cuda:  # the host waits for the router: a bounded spin, then asleep
            flat = to_host(flat)
        if flat.dtype is not torch.int64:
            flat = flat.to(torch.int64)
        flat = flat.contiguous()
        routed = pool.route(self.shape.layer, flat)
        self._score(routed)
        return flat, pool, routed

    def _score(self, routed: Routed) -> None:
        """The layer before's look-ahead for this call: its prediction scored, and how many of
        the call's experts it fetched (``incoming.arrived``). The library's plan scores its
        calls itself (:meth:`LayerCall.run`)."""
        came = self.incoming
        came.arrived = 0
        if came.pending:
            assert self.runtime is not None
            needed = set(routed.needed.tolist())
            predicted = came.predicted
            if predicted is not None:
                self.runtime.stats.record_lookahead(self.shape.layer, len(predicted),
                                                    len(predicted & needed), len(needed))
            came.arrived = len(came.prefetched & needed)
            came.clear()

    def _must_stream(self, needed: int, misses: int, pool: SlotPool) -> bool:
        return needed > pool.num_slots or misses > self._stream_above()

    def _plan(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              host: HostCopies | None = None) -> torch.Tensor | None:
        """The host's part of a gathered call: fetch the misses, publish the layer's slot table
        for :meth:`_from_table`. Returns what :meth:`_from_table` does not compute (streamed
        experts here, the CPU's share in hybrid), or None. Between graph pieces, ``host`` holds
        the inputs already copied to the host."""
        t0 = time.perf_counter()
        prep = self.prepared
        call = prep.call if host is not None and prep.host is host else None
        prep.host = prep.call = None
        fresh = call is None  # else its rule was set by :meth:`_prepare`
        if fresh and host is not None:
            call = self._layer_call(host)
        if call is not None:
            if fresh:
                self._rule(call.c.rule, host)
            if call.run() == STREAMS:
                routed = call.routed()
                call.pool.publish(self.shape.layer, empty=True)
                return self._streamed(x, ids, w, call.pool, routed.hits(), routed.missed())
            return self._planned(x, call, host, t0)
        flat, pool, routed = self._route(ids if host is None else host.ids)
        if self._must_stream(routed.needed.size, routed.misses, pool):
            pool.publish(self.shape.layer, empty=True)
            return self._streamed(x, ids, w, pool, routed.hits(), routed.missed())
        return self._plan_misses(x, ids, w, flat, pool, routed, host, t0)

    def _prepare(self, host: HostCopies) -> None:
        """What a plan between pieces does without inputs, while the piece before computes
        (``HostStep.prepare``): the library's call found, armed (:meth:`LayerCall.arm`) and its
        fetch rule set; :meth:`_plan` then only runs it."""
        call = self._layer_call(host)
        if call is not None:
            self._rule(call.c.rule, host)
            call.arm()
        self.prepared.host, self.prepared.call = host, call

    def _layer_call(self, host: HostCopies) -> LayerCall | None:
        """The library's plan of a call between graph pieces (:mod:`.layer_call`), or None
        where the Python plan runs."""
        calls = self.layer_calls
        return None if calls is None else calls.get(host)

    def _make_call(self, host: HostCopies, job: HostJob | None = None) -> LayerCall | None:
        """The library's plan on ``host`` (at its first call), submitting ``job`` for the
        CPU's pairs if given."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        pool = rt.cache.pool(self.shape.layer)
        assert isinstance(pool, NativeSlotPool)
        return LayerCall(pool, rt, bank, self.shape.layer, host, self._stream_above(), job,
                         self.incoming, self.lookahead)

    def _stream_above(self) -> int:
        """The most misses a call fetches into the cache; more are streamed."""
        return int(STREAM_ABOVE * self.shape.num_experts)

    def _rule(self, rule: FetchRule, host: HostCopies) -> None:
        """The call's fetch rule for the library's plan: every miss (set when it was made)."""

    def _planned(self, x: torch.Tensor, call: LayerCall, host: HostCopies,
                 t0: float) -> torch.Tensor | None:
        """What follows the library's plan: look-ahead and the call's stats (as
        :meth:`_plan_misses` ends)."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        c = call.c
        self._ahead(x, call, host)
        rt.stats.record(self.shape.layer, x.shape[0], c.n_needed - c.misses, c.n_fetched,
                        c.n_fetched * bank.expert_bytes, fetch=call.fetch,
                        plan_s=time.perf_counter() - t0)
        return None

    def _ahead(self, x: torch.Tensor, call: LayerCall, host: HostCopies) -> None:
        """After the library's plan: the next piece let start (``host.ready``); look-ahead
        here where the library did not make it (:meth:`_prefetch` lets the piece start first)."""
        if call.ahead is None and self.lookahead is not None:
            self._prefetch(x, call.routed(), call.split(), host)
        elif host.ready is not None:
            host.ready()

    def _plan_misses(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     flat: torch.Tensor, pool: SlotPool, routed: Routed, host: HostCopies | None,
                     t0: float) -> torch.Tensor | None:
        """What :meth:`_plan` does with a call's misses (``t0``: when the plan began)."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        split = pool.split(self.shape.layer, flat, routed, routed.misses)
        fetch = self._fetch(pool, split)
        pool.publish(self.shape.layer)
        self._prefetch(x, routed, split, host)
        n = split.fetched.size
        rt.stats.record(self.shape.layer, x.shape[0], routed.n_hits, n,
                        n * bank.expert_bytes, fetch=fetch, plan_s=time.perf_counter() - t0)
        return None

    def _from_table(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Every pair whose expert the published slot table holds, gathered from its slot with
        the fused kernels or resident's; the other pairs count 0. Device work only
        (capturable). A fused kernel that fails to build (its first call is in the eager
        warm-up before any capture) leaves the layer on resident's kernels, with a warning."""
        assert self.runtime is not None
        pool = self.runtime.cache.pool(self.shape.layer)
        table = pool.device_tables[self.shape.layer]
        views = [self._pool_view(pool, p) for p in PROJECTIONS]
        bias = self.bias()
        bias = bias and bias.rows(ids.reshape(-1))
        if self.gpu_kernel == "fused":  # the slots' blocks read in place
            try:
                return gathered_fused(x, w, ids.reshape(-1), *views, self.act, bias, table)
            except Exception as e:
                if not raised_by_triton(e):
                    raise
                log.warning("layer %d: the fused %s kernel failed to build (%s: %s); its "
                            "experts use dequantise + matmul", self.shape.layer,
                            "/".join(v.fmt for v in views), type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "")
                self.gpu_kernel = "dequant"
        return gathered_reference(x, w, ids.reshape(-1), *views, self.act, bias, table)

    def _runtime(self) -> OffloadRuntime:
        if self.runtime is None or self.bank is None:
            raise RuntimeError(f"layer {self.shape.layer}: offloaded experts used before "
                               "attach() gave them a cache")
        return self.runtime

    def _serve(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, flat: torch.Tensor,
               pool: SlotPool, routed: Routed) -> torch.Tensor:
        """One decode-sized call: every miss fetched into the cache, then computed."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        split = pool.split(self.shape.layer, flat, routed, routed.misses)
        fetch = self._fetch(pool, split)
        self._prefetch(x, routed, split)
        compute = rt.stats.span()
        out = self._compute(x, ids, w, pool, slot_of(routed, split))
        n = split.fetched.size
        rt.stats.record(self.shape.layer, x.shape[0], routed.n_hits, n,
                        n * bank.expert_bytes, fetch=fetch, compute=compute.stop())
        return out

    def _fetch(self, pool: SlotPool, split: Split) -> Span | None:
        """The experts ``split`` gave slots copied from the bank into them; the compute stream
        waits for the copies (and for what look-ahead fetched for this call before)."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        if split.fetched.size:
            return rt.fetch(pool.data, split.slots, bank, split.fetched, wait=True)
        rt.wait_copies()
        return None

    def _prefetch(self, x: torch.Tensor, routed: Routed, split: Split,
                  host: HostCopies | None = None) -> None:
        """Look-ahead (:meth:`Lookahead.fetch`) after this call's plan: this call's slots
        (``routed``'s hits and ``split``'s fetches, which its compute still reads) stay. Between
        graph pieces the picks come with ``host``; an eager call routes them there. Inside the
        graph (``host.ready``) the call's compute is let start first."""
        if host is not None and host.ready is not None:  # inside the graph: compute may start
            host.ready()
        la, rt = self.lookahead, self.runtime
        if la is None or rt is None or (host is not None and host.predicted is None):
            return
        rule = la.target.prefetch_rule()
        if not (budget := la.wanted(x.shape[0], rule)):
            return
        # a miss's -1 in routed.slot is ignored
        keep = (np.concatenate((routed.slot, split.slots))
                if rt.cache.pool(la.layer) is rt.cache.pool(self.shape.layer)
                else split.slots[:0])
        la.fetch(rt, x, keep, None if host is None else host.predicted, budget, rule)

    def _compute(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pool: SlotPool,
                 slot_of: dict[int, int]) -> torch.Tensor:
        """The experts in ``slot_of`` from their slots, expert by expert with resident's
        kernel (too many pairs to gather, or the CPU); other experts' pairs are skipped."""
        return grouped(x, ids, w, self.shape.num_experts,
                       lambda e: self._row_weights(pool.data[slot_of[e]]), self.act,
                       only=slot_of, bias=self.bias())

    def prefetch_rule(self) -> AheadRule:
        """How many predicted misses look-ahead may fetch for this layer's next call: all
        (hybrid: a share)."""
        return EVERY

    def _pool_view(self, pool: SlotPool, proj: str) -> QuantTensor:
        """Projection ``proj`` of every slot (a view, made once: the pool never moves)."""
        assert self.bank is not None
        qt = self._pool_views.get(proj)
        if qt is None:
            qt = self._pool_views[proj] = self.bank.layout.quant(pool.data, proj)
        return qt

    def _row_weights(self, row: torch.Tensor) -> Weights:
        assert self.bank is not None
        lay = self.bank.layout
        return (lay.weight(row, "gate_proj", self.dtype), lay.weight(row, "up_proj", self.dtype),
                lay.weight(row, "down_proj", self.dtype))

    def _streamed(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pool: SlotPool,
                  hits: dict[int, int], misses: list[int]) -> torch.Tensor:
        """Misses through the staging buffers, hits from their slots; the cache is unchanged."""
        rt, bank = self.runtime, self.bank
        assert rt is not None and bank is not None
        rows = {e: pool.data[s] for e, s in hits.items()}
        return streamed_call(rt, bank, self.shape.layer, x.shape[0], rows, misses,
                             lambda row: grouped(x, ids, w, self.shape.num_experts, row,
                                                 self.act, bias=self.bias()),
                             self._row_weights)


def slot_of(routed: Routed, split: Split) -> dict[int, int]:
    """Expert -> slot of a call's hits and of the misses ``split`` fetched."""
    return routed.hits() | dict(zip(split.fetched.tolist(), split.slots.tolist(), strict=True))


def offload_stats(model: nn.Module, per_layer: bool = True) -> dict[str, Any] | None:
    """The stats snapshot of the model's offloaded layers, None if it has none."""
    for m in model.modules():
        if isinstance(m, OffloadExperts) and m.runtime is not None:
            return m.runtime.stats.snapshot(per_layer)
    return None
