"""Hybrid strategy: of a layer's cache misses, fetch a fraction f over PCIe (the most used
first) and compute the rest on the CPU from the same host bank, overlapped.

Per layer call (decode):
  route -> hits | misses; misses by use, descending -> the first n = round(f * misses) (capped
  by ``--moe-hybrid-max-fetch``) are fetched into cache slots, the rest go to the CPU pool:
  CPU submit (returns at once) -> copies on the copy stream -> slot table published -> the
  GPU's share queued (hits and fetched experts, through the table) -> CPU wait -> the CPU's
  result added. So the CPU computes while the link copies and the GPU computes. With decode
  CUDA graphs the plan runs between two pieces, the CPU wait between the next two (no sync),
  and the GPU's share is captured in between.
f starts from the layer's bandwidth-profile row (``pcie_ov / (pcie_ov + cpu_ov)``) and
:class:`SplitPolicy` moves it toward the split with the shortest step (CPU and PCIe finishing
together, counting the host time the CPU half costs), from the times it measures each
step. Prefill chunks that miss most experts stream them to the GPU like offload does.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken import env
from freetoken.cpu import executor as cx
from freetoken.cpu.abi import PROBINGS, FetchRule
from freetoken.cpu.gpu_wait import to_host
from freetoken.cpu.jobs import CpuMoeFuture
from freetoken.errors import ConfigError
from freetoken.moe.cpu_share import Calls, Pending, submit_share
from freetoken.moe.host_banks import PROJECTIONS
from freetoken.moe.host_job import HostJob, HostJobs
from freetoken.moe.host_steps import HostCopies
from freetoken.moe.layer_call import LayerCall
from freetoken.moe.layer_kind import LayerKind, cpu_format, kind_words
from freetoken.moe.lookahead import EVERY, NONE, AheadRule
from freetoken.moe.offload import OffloadExperts, slot_of
from freetoken.moe.runtime import OffloadRuntime
from freetoken.moe.slot_pool import Routed, SlotPool, Split
from freetoken.moe.split import SplitCosts, SplitPolicy
from freetoken.moe.stats import Span
from freetoken.moe.strategy import ExpertShape, LayerPlan, Needs, Shared
from freetoken.moe.wall_check import WallCheck
from freetoken.quant import QuantTensor, get_format

log = logging.getLogger(__name__)

class HybridExperts(OffloadExperts):
    """Offload's bank and cache, plus the CPU executor for the misses it does not fetch."""

    NEEDS = Needs(cpu_pool=True, host_banks=True, device_cache=True)
    PLAN_READS_INPUTS = True  # the CPU's share reads the hidden states and weights
    FINISHES_LATE = True  # the CPU's share is collected after the device's is queued

    def __init__(self, shape: ExpertShape) -> None:
        if (why := shape.native_missing()) is not None:
            raise ConfigError(f"--moe-strategy hybrid cannot run layer {shape.layer}: {why}")
        reason = cx.available()
        if reason is not None:
            raise ConfigError(f"--moe-strategy hybrid needs the CPU MoE library, but {reason}")
        super().__init__(shape)
        self.policy = SplitPolicy()
        self.executor: cx.CpuMoeExecutor | None = None
        self.calls = Calls()  # per-call state, kept off nn.Module's slow attribute setter
        self.host_jobs = HostJobs(shape.layer)  # the CPU's share between graph pieces
        self.prefetch = env.hybrid_prefetch()  # look-ahead's share of predicted misses

    def load_expert_tensor(self, proj: str, qt: QuantTensor, expert: int | None = None) -> bool:
        """As offload, with f32 and f16 weights kept as bf16 (what the CPU kernels read)."""
        if qt.fmt in ("f32", "f16"):
            qt = get_format("bf16").quantize(get_format(qt.fmt).dequantize(qt))
        return super().load_expert_tensor(proj, qt, expert)

    def kind(self) -> LayerKind:
        """The layer's kind as the bandwidth profile keys it (from its bank's formats)."""
        assert self.bank is not None
        fmt, options = cpu_format(*self.bank.layout.formats)
        s = self.shape
        return LayerKind(fmt, s.hidden, s.intermediate, s.top_k, options)

    def attach(self, plan: LayerPlan, shared: Shared) -> None:
        """Offload's cache, the bank handed to the CPU pool (read in place) and the split."""
        super().attach(plan, shared)
        bank = self.bank
        if shared.pool is None or bank is None:
            raise RuntimeError(f"layer {self.shape.layer}: hybrid experts need the CPU pool "
                               "and their loaded bank")
        gate, up, down = (cx.ExpertStack.from_quant([bank.layout.quant(bank.rows[e], p)
                                                     for e in range(bank.num_experts)])
                          for p in PROJECTIONS)
        self.executor = shared.pool
        self.executor.add_layer(self.shape.layer, gate, up, down, **self.native_glu())
        f = plan.fetch_fraction
        kind = self.kind()
        costs = shared.splits.setdefault(kind, SplitCosts(layers=0))
        costs.layers += 1
        if costs.check is None and env.wall_check() == "on":
            costs.check = WallCheck(kind_words(kind))
        if costs.check is not None:
            costs.check.layers = costs.layers
            if plan.split_from and plan.online:  # the profile's split: held until beaten
                costs.check.use_profile(f)
            if plan.start_fetch and plan.online:  # its decode check lost to offload
                costs.check.start_fetch()
        self.policy = SplitPolicy(f, plan.max_fetch, plan.online,
                                  probe_fraction=f if f is not None and f < 1 else 0.5,
                                  costs=costs)
        # reported from the start: a layer whose calls all stream (more experts than its
        # cache holds) still shows its split
        self._runtime().stats.set_fraction(self.shape.layer, self.policy.fraction)

    def _runtime(self) -> OffloadRuntime:
        if self.executor is None:
            raise RuntimeError(f"layer {self.shape.layer}: hybrid experts used before "
                               "attach() gave them the CPU pool")
        return super()._runtime()

    def _plan(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              host: HostCopies | None = None) -> torch.Tensor | None:
        """Offload's plan with the CPU's share (:meth:`_plan_misses`), or, while the wall
        check runs or holds its cpu arm, :meth:`_plan_all_on_cpu` without routing."""
        prep = self.prepared
        if host is None or prep.host is not host:  # else :meth:`_prepare` started it
            self.policy.start(x.shape[0])
        if self.policy.all_cpu:
            prep.host = prep.call = None
            return self._plan_all_on_cpu(x, ids, w, host)
        return super()._plan(x, ids, w, host)

    def _prepare(self, host: HostCopies) -> None:
        """Offload's, the call started first (the wall check counts it, which may move the
        arm it holds): the split's rule is set before the inputs arrive."""
        self.policy.start(host.ids.shape[0])
        self.prepared.host, self.prepared.call = host, None
        if not self.policy.all_cpu:
            super()._prepare(host)

    def _plan_misses(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     flat: torch.Tensor, pool: SlotPool, routed: Routed,
                     host: HostCopies | None,
                     t0: float) -> torch.Tensor | None:
        """The CPU's share submitted, the most used misses fetched and the slot table
        published (the CPU's experts stay out of it, so :meth:`_from_table` gives their pairs
        0). The CPU's result is left for :meth:`_finish`, so the device computes its share
        meanwhile. Between graph pieces the split writes the CPU's pairs straight into the
        host job's ids."""
        assert self.executor is not None
        job = None if host is None or not host.inputs else self.host_jobs.get(self.executor,
                                                                              host)
        n = self._count(flat, routed)
        cpu_ids = torch.empty_like(flat) if job is None else job.ids
        split = pool.split(self.shape.layer, flat, routed, n, cpu_ids)
        future, overhead = self._share(x, ids, w, split, cpu_ids, job,
                                       0 if host is None else host.cpu_done)
        fetch = self._fetch(pool, split)
        pool.publish(self.shape.layer)
        self.calls.table_empty = False
        self._prefetch(x, routed, split, host)
        self._pend(x, routed.n_hits, split.fetched.size, split.cpu, fetch, future, overhead,
                   host, t0)
        return None

    def _pend(self, x: torch.Tensor, hits: int, fetched: int, on_cpu: int, fetch: Span | None,
              future: CpuMoeFuture | None, overhead: float, host: HostCopies | None,
              t0: float, split: bool = True) -> None:
        """A planned call whose CPU share runs on, left for :meth:`_finish`: its counts
        recorded now, while the engine thread's caches are its own (after its wait for the
        CPU they hold expert weights), its CPU time by :meth:`_finish`."""
        self._record(x, hits, fetched, on_cpu, fetch, None, 0.0, time.perf_counter() - t0)
        self.calls.pending = Pending(x, fetched, on_cpu, fetch, future, overhead, host, split)

    def _layer_call(self, host: HostCopies) -> LayerCall | None:
        """Offload's, with the CPU's job; the Python plan while the pool has no room."""
        assert self.executor is not None
        return super()._layer_call(host) if self.executor.has_room else None

    def _make_call(self, host: HostCopies, job: HostJob | None = None) -> LayerCall | None:
        """Offload's, submitting the CPU's job on the host copies (None where the job reads
        float32 copies of copies of another dtype: the Python plan converts them); offload's
        own on copies of the ids alone (a step that fetches every miss)."""
        assert self.executor is not None
        if not host.inputs:
            return super()._make_call(host)
        job = self.host_jobs.get(self.executor, host)
        if job.x is not host.x or job.w is not host.w:
            return None
        return super()._make_call(host, job)

    def _rule(self, rule: FetchRule, host: HostCopies) -> None:
        """The split's count for this call (the last call's times observed first), over the
        misses there would have been without look-ahead (as :meth:`_count`)."""
        self._observe_last()
        if self.policy.fetching:  # a call without the CPU's job fetches every miss anyway
            return
        self.policy.rule(rule)  # rule.arrived: the library counts it from self.incoming

    def _planned(self, x: torch.Tensor, call: LayerCall, host: HostCopies,
                 t0: float) -> torch.Tensor | None:
        """What follows the library's plan: the probe it made, the CPU job's future, look-ahead
        and the pending call for :meth:`_finish` (as :meth:`_plan_misses` ends). A call that
        fetches every miss (:meth:`_plan_fetching`) ends as offload's, with nothing pending:
        only its times are kept for the split's model."""
        assert self.executor is not None
        c = call.c
        self.calls.table_empty = False
        if self.policy.fetching:  # offload's, the call kept for the split's model to learn from
            super()._planned(x, call, host, t0)
            self.policy.probing = ""
            self.calls.last = (0, 0.0, c.n_fetched, call.fetch, 0.0)
            self._runtime().stats.set_fraction(self.shape.layer, 1.0)
            return None
        self.policy.probed(PROBINGS[c.probing])
        future = None
        if c.n_cpu:
            assert call.job is not None
            future = self.executor.adopt(c.ticket, call.job.job)
        self._ahead(x, call, host)
        self._pend(x, c.n_needed - c.misses, c.n_fetched, c.n_cpu, call.fetch, future,
                   c.submit_ns / 1e9, host, t0)
        return None

    def _plan_fetching(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                       host: HostCopies) -> torch.Tensor | None:
        """Offload's plan in a step made to fetch every miss (its graphs have no late step):
        the split held at all-fetch for the call, which the wall check counts as one of the
        arm it holds, then the call collected at once (its CPU share is none)."""
        self.policy.fetching = True
        try:
            early = self._plan(x, ids, w, host)
        finally:
            self.policy.fetching = False
        late = self._finish()
        assert late is None, "a call that fetches every miss left a CPU share"
        return early

    def fetches_next_step(self) -> bool:
        """Whether the next decode step's call fetches every miss (:meth:`SplitPolicy.
        fetches_next` over the kind's calls in one step)."""
        return self.policy.fetches_next(self.policy.costs.layers)

    def _plan_all_on_cpu(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                         host: HostCopies | None) -> None:
        """The wall check's cpu arm (timed or held) in a gathered call: every routed pair on
        the pool, hits too, as the cpu strategy runs a layer: no routing through the cache,
        no split, no copies, an empty slot table (the device's share is nothing). Its times
        do not reach the split's model (its jobs are not the split's)."""
        assert self.executor is not None and self.runtime is not None
        t0 = time.perf_counter()
        self.calls.last = None
        self.incoming.clear()  # nothing the layer before fetched is read
        if not self.calls.table_empty:  # an empty table stays so until a split publishes
            layer = self.shape.layer
            self.runtime.cache.pool(layer).publish(layer, empty=True)
            self.calls.table_empty = True
        if host is not None:
            future = self.host_jobs.get(self.executor, host).submit(True, host.cpu_done)
            flat = host.ids
        else:
            flat = (to_host(ids.reshape(-1)) if ids.is_cuda else ids.reshape(-1)).long()
            future = submit_share(self.executor, x, ids, w, flat, self.shape.layer)
        experts = flat.numel() if x.shape[0] == 1 else len(set(flat.reshape(-1).tolist()))
        self._pend(x, 0, 0, experts, None, future, time.perf_counter() - t0, host, t0,
                   split=False)

    def _finish(self) -> torch.Tensor | None:
        """The CPU's result of the last plan on the device (between graph pieces: in
        ``host.cpu_out``, which the graph step copies in), and the call's stats."""
        p, self.calls.pending = self.calls.pending, None
        if p is None:
            return None
        cpu_out, t_cpu, overhead = self._collect(p.future, p.on_cpu, p.x, p.overhead,
                                                  p.host)
        if p.split:
            self.calls.last = (p.on_cpu, t_cpu, p.fetched, p.fetch, overhead)
        if t_cpu:
            assert self.runtime is not None
            self.runtime.stats.record_cpu(self.shape.layer, t_cpu)
        return cpu_out

    def _serve(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               flat: torch.Tensor, pool: SlotPool, routed: Routed) -> torch.Tensor:
        """A call with too many pairs to gather (or on the CPU): the CPU's share submitted
        first, the fetched experts and hits computed expert by expert meanwhile."""
        rt = self.runtime
        assert rt is not None
        cpu_ids = torch.empty_like(flat)
        self.policy.start(x.shape[0])
        split = self._split(pool, flat, routed, cpu_ids)
        future, overhead = self._share(x, topk_ids, topk_weights, split, cpu_ids)
        fetch = self._fetch(pool, split)
        self._prefetch(x, routed, split)
        compute = rt.stats.span()
        slots = slot_of(routed, split)
        out = (self._compute(x, topk_ids, topk_weights, pool, slots) if slots
               else torch.zeros_like(x))
        compute.stop()
        cpu_out, t_cpu, overhead = self._collect(future, split.cpu, x, overhead)
        self.calls.last = (split.cpu, t_cpu, split.fetched.size, fetch, overhead)
        self._record(x, routed.n_hits, split.fetched.size, split.cpu, fetch, compute, t_cpu)
        return out if cpu_out is None else out + cpu_out

    def _split(self, pool: SlotPool, flat: torch.Tensor, routed: Routed,
               cpu_ids: torch.Tensor) -> Split:
        """The policy's count of misses fetched (the most used; :meth:`SlotPool.split` gives
        them slots), the rest the CPU's (their pairs written to ``cpu_ids``)."""
        n = self._count(flat, routed)
        return pool.split(self.shape.layer, flat, routed, n, cpu_ids)

    def _count(self, flat: torch.Tensor, routed: Routed) -> int:
        """The policy's count of misses to fetch for the call it started. The last call's
        times reach the policy first (the probe flag is this call's)."""
        self._observe_last()
        misses, arrived = routed.misses, self.incoming.arrived
        # experts look-ahead fetched count as fetched: the split is over the misses there
        # would have been without it
        n = self.policy.count(misses + arrived) - arrived
        if self.policy.probing == "pcie":  # a probe still times one fetch
            n = max(n, 1)
        return max(0, min(n, misses))

    def prefetch_rule(self) -> AheadRule:
        """How many predicted misses look-ahead fetches for this layer's next call while the
        layer before computes: FREETOKEN_HYBRID_PREFETCH's share of them (0.4), or the
        split's where that is more, within ``--moe-hybrid-max-fetch`` (what arrives
        counts as fetched); all while the wall check runs all-fetch, none before the split has
        a share or while every expert goes to the CPU.

        More than the split's share, because the link is idle between the CPU's jobs: from
        one layer's CPU wait to the next layer's plan the GPU runs attention and routing. The
        next call counts what arrived as fetched (:meth:`_count`), so its CPU gets the rest.
        On the 48-layer qwen3-30b-a3b q8_0 file (H100, 4 GB cache, 15 threads, 128 sampled
        tokens, two runs) 0.4 decoded 42.8 and 40.2 tok/s; the split's share 37.7 (0.3:
        37.6); look-ahead only while the split fetched every miss, as before, 38.3 and 35.5;
        0.55 overran the link (31.5, 34.4)."""
        p = self.policy
        if p.all_fetch:
            return EVERY
        share = p.share
        if share is None or p.all_cpu:
            return NONE
        return AheadRule(share, self.prefetch, None if p.held is not None else p.max_fetch)

    def _share(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, split: Split,
               cpu_ids: torch.Tensor, job: HostJob | None = None, signal: int = 0,
               ) -> tuple[CpuMoeFuture | None, float]:
        """The CPU's share on the pool (``cpu_ids``: the pairs of other experts as -1), if it
        has one, and the seconds its submit took; returns at once. With a host ``job`` (whose
        ids ``cpu_ids`` are), it reads the host copies and writes into their ``cpu_out``, and
        sets ``signal`` (a flag's address, 0: none) once it has."""
        if not split.cpu:
            return None, 0.0
        t0 = time.perf_counter()
        if job is not None:
            return job.submit(False, signal), time.perf_counter() - t0
        return (submit_share(self.executor, x, ids, w, cpu_ids, self.shape.layer),
                time.perf_counter() - t0)

    def _collect(self, future: CpuMoeFuture | None, experts: int, x: torch.Tensor,
                 overhead: float, host: HostCopies | None = None,
                 ) -> tuple[torch.Tensor | None, float, float]:
        """The CPU's result on ``x``'s device (left in ``host.cpu_out`` with ``host``), the
        pool's time on it, and the host overhead. On CUDA the result goes through a pinned
        buffer without waiting for the stream (which may still be waiting for the copies): the
        buffer is rewritten only at this layer's next call, after the host has synced on that
        call's routed ids."""
        if future is None:
            return None, 0.0, overhead
        out = future.wait()
        self.calls.jobs.add(future, experts)
        t0 = time.perf_counter()
        if host is None:  # else the pool wrote host.cpu_out, which the graph step copies in
            out = self.calls.to_device(out, x)
        return out, future.seconds, overhead + time.perf_counter() - t0

    def _record(self, x: torch.Tensor, hits: int, fetched: int, on_cpu: int,
                fetch: Span | None, compute: Span | None, t_cpu: float,
                plan_s: float = 0.0) -> None:
        """A call's counts of experts (hits, fetched, on the CPU) and times in the stats."""
        rt, bank, layer = self.runtime, self.bank, self.shape.layer
        assert rt is not None and bank is not None
        rt.stats.record(layer, x.shape[0], hits, fetched, fetched * bank.expert_bytes,
                        fetch=fetch, compute=compute, cpu_experts=on_cpu, cpu_s=t_cpu,
                        plan_s=plan_s)
        rt.stats.set_fraction(layer, self.policy.share)

    def _observe_last(self) -> None:
        """Feed the previous call's times to the policy (its copy has finished by now: the
        host has synced on this call's routed ids since)."""
        if self.calls.last is None:
            return
        n_cpu, t_cpu, n_fetch, span, overhead = self.calls.last
        t_pcie = span.done() if span is not None else 0.0
        if t_pcie is not None:
            self.policy.observe(n_cpu, t_cpu, n_fetch, t_pcie, overhead)
        self.calls.last = None
