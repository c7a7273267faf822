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
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from freetoken.cpu import executor as cx
from freetoken.cpu.jobs import CpuMoeFuture
from freetoken.errors import ConfigError
from freetoken.moe.expert_cache import SlotPool
from freetoken.moe.host_banks import PROJECTIONS
from freetoken.moe.layer_kind import LayerKind, cpu_format
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.pieces import HostCopies
from freetoken.moe.runtime import OffloadRuntime
from freetoken.moe.stats import Span
from freetoken.moe.strategy import ExpertShape, LayerPlan, Needs, Shared
from freetoken.quant import QuantTensor, get_format

log = logging.getLogger(__name__)

PROBE_FIRST = 8  # calls after which a side left idle first gets one expert, to time it again
REMEASURE_EVERY = 256  # the longest such wait (it doubles while the side keeps losing)


@dataclass
class SplitPolicy:
    """How many of a layer's misses to fetch; the rest run on the CPU.

    ``fraction``: share of misses fetched (None until a profile row or measurements give one);
    ``max_fetch``: cap on fetched experts per call (None: no cap). With ``online``, each
    observation updates smoothed costs: the CPU's time for a job of n experts as
    ``l_cpu + n * c_cpu`` (a fixed part: waking the pool and splitting the job, which a job of
    one expert pays as much as one of eight; fitted by least squares with forgetting over the
    job sizes seen), seconds per fetched expert (``c_pcie``), and the host time the CPU half
    adds to a call (``o``: handing over the hidden states and adding the result back). For
    the call's m misses the best n minimises
    ``max(n * c_pcie, l_cpu + (m - n) * c_cpu if n < m else 0) + (o if n < m else 0)``;
    ``fraction`` moves toward n / m by at most ``step`` per observation, so a wrong profile
    row, or a CPU half that costs more than it saves, is corrected toward the better split
    (all fetched, as offload, when the CPU does not pay). A side's first observation is a
    warm-up (first-use allocations, cold caches) and is not kept. A side without an estimate
    is given work so that it is measured; so is a side left idle, after PROBE_FIRST calls,
    then after twice as many each time the probe confirms it loses, up to REMEASURE_EVERY.
    The link is probed with one expert; the CPU with the share ``probe_fraction`` gives it
    (the profile row's), since a job of one expert measures mostly the fixed part.
    """

    fraction: float | None = None
    max_fetch: int | None = 1
    online: bool = True
    smoothing: float = 0.3
    step: float = 0.1
    probe_fraction: float = 0.5  # fetched share of a CPU probe's misses
    c_cpu: float | None = None  # seconds per expert on the CPU
    l_cpu: float = 0.0  # seconds per CPU job, whatever its size
    c_pcie: float | None = None  # seconds per fetched expert
    o: float = 0.0  # host seconds the CPU half adds to a call
    _idle_cpu: int = 0  # observations since the CPU last had an expert
    _idle_pcie: int = 0
    _probe_cpu: int = PROBE_FIRST  # idle observations before the CPU is probed again
    _probe_pcie: int = PROBE_FIRST
    _seen_cpu: int = 0  # observations with CPU work (the first is the warm-up)
    _seen_pcie: int = 0
    probing: str = ""  # "cpu" or "pcie": n_fetch gave that idle side work to time it
    _fit: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)  # CPU sums

    def planned(self, misses: int) -> int:
        """The split's fetch count for ``misses`` before any probe."""
        n = misses if self.fraction is None else round(self.fraction * misses)
        return n if self.max_fetch is None else min(n, self.max_fetch)

    def n_fetch(self, misses: int) -> int:
        n = self.planned(misses)
        self.probing = ""
        if self.online and misses >= 2:  # keep both sides measured, so f can move back
            if n == 0 and (self.c_pcie is None or self._idle_pcie >= self._probe_pcie):
                n, self.probing = 1, "pcie"
            if n == misses and (self.c_cpu is None or self._idle_cpu >= self._probe_cpu):
                k = min(misses, max(1, round((1 - self.probe_fraction) * misses)))
                n, self.probing = misses - k, "cpu"
        return n

    def observe(self, n_cpu: int, t_cpu: float, n_fetch: int, t_pcie: float,
                overhead: float = 0.0) -> None:
        if not self.online:
            return
        self._idle_cpu = 0 if n_cpu else self._idle_cpu + 1
        self._idle_pcie = 0 if n_fetch else self._idle_pcie + 1
        if n_cpu > 0 and t_cpu > 0:
            self._seen_cpu += 1
            if self._seen_cpu > 1:
                self._fit_cpu(n_cpu, t_cpu)
                self.o = self._smooth(self.o, overhead)
        if n_fetch > 0 and t_pcie > 0:
            self._seen_pcie += 1
            if self._seen_pcie > 1:
                self.c_pcie = self._smooth(self.c_pcie, t_pcie / n_fetch)
        m = n_cpu + n_fetch
        if self.c_cpu is None or self.c_pcie is None or m == 0:
            return
        c_cpu, c_pcie, o, l_cpu = self.c_cpu, self.c_pcie, self.o, self.l_cpu
        best = min(range(m + 1), key=lambda n: max(n * c_pcie, l_cpu + (m - n) * c_cpu)
                   + o if n < m else n * c_pcie)
        # a probed side that still loses waits twice as long for its next probe; a side
        # the split itself uses is probed soon once it goes idle
        if n_cpu:
            lost = self.probing == "cpu" and best == m
            self._probe_cpu = min(2 * self._probe_cpu, REMEASURE_EVERY) if lost else PROBE_FIRST
        if n_fetch:
            lost = self.probing == "pcie" and best == 0
            self._probe_pcie = (min(2 * self._probe_pcie, REMEASURE_EVERY) if lost
                                else PROBE_FIRST)
        target = best / m
        if self.fraction is None:
            self.fraction, self.max_fetch = target, None
            return
        delta = max(-self.step, min(self.step, target - self.fraction))
        self.fraction = min(1.0, max(0.0, self.fraction + delta))

    def _fit_cpu(self, n: int, t: float) -> None:
        """One CPU job of ``n`` experts that took ``t``: ``l_cpu`` and ``c_cpu`` refitted. The
        sums decay by ``1 - smoothing`` per job; while the jobs seen are all of one size the
        fixed part keeps its last estimate and the per-expert cost takes the rest."""
        keep = 1 - self.smoothing
        s0, s1, s2, t0, t1 = (keep * v for v in self._fit)
        self._fit = s0, s1, s2, t0, t1 = s0 + 1, s1 + n, s2 + n * n, t0 + t, t1 + n * t
        det = s0 * s2 - s1 * s1
        if det > 0.05 * s0 * s0:  # job sizes vary enough (n's variance > 0.05)
            c = (s0 * t1 - s1 * t0) / det
            lat = (t0 - c * s1) / s0
            if c > 0 and lat >= 0:
                self.c_cpu, self.l_cpu = c, lat
                return
        self.l_cpu = min(self.l_cpu, t0 / s0)
        self.c_cpu = max((t0 - self.l_cpu * s0) / s1, 1e-9)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new


@dataclass(frozen=True)
class _Pending:
    """A planned call whose CPU share is still running: what :meth:`HybridExperts._finish`
    needs to collect it and record the call."""

    x: torch.Tensor
    hits: dict[int, int]
    fetched: list[int]
    on_cpu: set[int]
    fetch: Span | None
    future: CpuMoeFuture | None
    overhead: float
    host: HostCopies | None
    plan_s: float


class _HostJob:
    """The CPU's share of calls that read one set of host copies (a decode graph's pinned
    buffers, :class:`HostCopies`), checked once: its ids buffer, float32 copies of x and w
    where the host copies are of another dtype, and the executor's prepared job."""

    def __init__(self, executor: cx.CpuMoeExecutor, layer: int, host: HostCopies) -> None:
        self.host = host
        self.x = host.x if host.x.dtype is torch.float32 else torch.empty(
            host.x.shape, dtype=torch.float32)
        self.w = host.w if host.w.dtype is torch.float32 else torch.empty(
            host.w.shape, dtype=torch.float32)
        self.ids = torch.empty(host.ids.shape, dtype=torch.int64)
        self._ids = self.ids.numpy().reshape(-1)
        self.job = executor.prepare(self.x, self.ids, self.w, layer, host.cpu_out)
        self.executor = executor

    def submit(self, cpu_ids: list[int]) -> CpuMoeFuture:
        """The job with these ids (-1: not the CPU's), on the host copies' current values."""
        if self.x is not self.host.x:
            self.x.copy_(self.host.x)
        if self.w is not self.host.w:
            self.w.copy_(self.host.w)
        self._ids[:] = cpu_ids
        return self.executor.submit_prepared(self.job)


class _Calls:
    """A layer's state between its calls: the last call's times for the policy, the planned
    call whose CPU share is running, the pinned buffer of the CPU's result (eager CUDA)."""

    def __init__(self) -> None:
        self.last: tuple[int, float, int, Span | None, float] | None = None
        self.pending: _Pending | None = None
        self.staged: torch.Tensor | None = None
        # per host-copy buffer: the CPU's job, checked once (:class:`_HostJob`)
        self.jobs: dict[tuple[int, int], _HostJob] = {}


class HybridExperts(OffloadExperts):
    """Offload's bank and cache, plus the CPU executor for the misses it does not fetch."""

    NEEDS = Needs(cpu_pool=True, host_banks=True, device_cache=True)
    PLAN_READS_INPUTS = True  # the CPU's share reads the hidden states and weights
    FINISHES_LATE = True  # the CPU's share is collected after the device's is queued
    # --moe-lookahead auto predicts for these only while the split fetches every miss: with
    # a CPU share, on the H200 (12-layer qwen3-30b-a3b q8_0, 4 GB cache) it measured 128.6 /
    # 107.0 / 87.8 tok/s against 181.0 / 101.6 / 103.5 without; the prediction adds host time
    # to a plan the CPU's share already waits on
    LOOKAHEAD_BY_DEFAULT = False

    def __init__(self, shape: ExpertShape) -> None:
        if (why := shape.native_missing()) is not None:
            raise ConfigError(f"--moe-strategy hybrid cannot run layer {shape.layer}: {why}")
        reason = cx.available()
        if reason is not None:
            raise ConfigError(f"--moe-strategy hybrid needs the CPU MoE library, but {reason}")
        super().__init__(shape)
        self.policy = SplitPolicy()
        self.executor: cx.CpuMoeExecutor | None = None
        self.calls = _Calls()  # per-call state, kept off nn.Module's slow attribute setter

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
        self.executor.add_layer(self.shape.layer, gate, up, down,
                                activation=self.shape.activation)
        f = plan.fetch_fraction
        self.policy = SplitPolicy(f, plan.max_fetch, plan.online,
                                  probe_fraction=f if f is not None and f < 1 else 0.5)
        # reported from the start: a layer whose calls all stream (more experts than its
        # cache holds) still shows its split
        self._runtime().stats.set_fraction(self.shape.layer, self.policy.fraction)

    def _runtime(self) -> OffloadRuntime:
        if self.executor is None:
            raise RuntimeError(f"layer {self.shape.layer}: hybrid experts used before "
                               "attach() gave them the CPU pool")
        return super()._runtime()

    def _plan_misses(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                     flat: list[int], pool: SlotPool, hits: dict[int, int], misses: list[int],
                     host: HostCopies | None, t0: float) -> torch.Tensor | None:
        """The CPU's share submitted, the most used misses fetched and the slot table
        published (the CPU's experts stay out of it, so :meth:`_from_table` gives their pairs
        0). The CPU's result is left for :meth:`_finish`, so the device computes its share
        meanwhile."""
        fetched, on_cpu = self._split(flat, misses)
        future, overhead = self._submit(x, ids, w, flat, on_cpu, host)
        slot_of, fetch = self._fetch(pool, hits, fetched)
        pool.publish(self.shape.layer)
        self._prefetch(x if host is None else host.x, set(slot_of.values()))
        plan_s = time.perf_counter() - t0
        self.calls.pending = _Pending(x, hits, fetched, on_cpu, fetch, future, overhead, host,
                                      plan_s)
        return None

    def _finish(self) -> torch.Tensor | None:
        """The CPU's result of the last plan on the device (between graph pieces: in
        ``host.cpu_out``, which the graph step copies in), and the call's stats."""
        p, self.calls.pending = self.calls.pending, None
        if p is None:
            return None
        cpu_out, t_cpu, overhead = self._collect(p.future, p.x, p.overhead, p.host)
        self._record(p.x, p.hits, p.fetched, p.on_cpu, p.fetch, None, t_cpu, overhead,
                     p.plan_s)
        return cpu_out

    def _serve(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
               flat: list[int], pool: SlotPool, hits: dict[int, int],
               misses: list[int]) -> torch.Tensor:
        """A call with too many pairs to gather (or on the CPU): the CPU's share submitted
        first, the fetched experts and hits computed expert by expert meanwhile."""
        rt = self.runtime
        assert rt is not None
        fetched, on_cpu = self._split(flat, misses)
        future, overhead = self._submit(x, topk_ids, topk_weights, flat, on_cpu)
        slot_of, fetch = self._fetch(pool, hits, fetched)
        self._prefetch(x, set(slot_of.values()))
        compute = rt.stats.span()
        out = (self._compute(x, topk_ids, topk_weights, pool, slot_of) if slot_of
               else torch.zeros_like(x))
        compute.stop()
        cpu_out, t_cpu, overhead = self._collect(future, x, overhead)
        self._record(x, hits, fetched, on_cpu, fetch, compute, t_cpu, overhead)
        return out if cpu_out is None else out + cpu_out

    def _split(self, flat: list[int], misses: list[int]) -> tuple[list[int], set[int]]:
        """Misses to fetch (the policy's count, most used first) and misses for the CPU. The
        last call's times reach the policy first (n_fetch's probe flag is this call's)."""
        self._observe_last()
        uses = Counter(flat)
        by_use = sorted(misses, key=lambda e: (-uses[e], e))
        # experts look-ahead fetched count as fetched: the split is over the misses there
        # would have been without it
        n = self.policy.n_fetch(len(misses) + self.arrived) - self.arrived
        if self.policy.probing == "pcie":  # a probe still times one fetch
            n = max(n, 1)
        n = max(0, min(n, len(misses)))
        return sorted(by_use[:n]), set(by_use[n:])

    def prefetch_share(self, misses: int) -> int:
        """The share of predicted misses the split would fetch (none before it has one)."""
        return 0 if self.policy.fraction is None else self.policy.planned(misses)

    def fetches_all(self) -> bool:
        p = self.policy
        return p.fraction is not None and p.fraction >= 1.0 and p.max_fetch is None

    def _submit(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, flat: list[int],
                on_cpu: set[int], host: HostCopies | None = None,
                ) -> tuple[CpuMoeFuture | None, float]:
        """The CPU's share on the pool (pairs of other experts as -1); returns at once. With
        ``host``, it reads the host copies and writes into ``host.cpu_out``."""
        if not on_cpu:
            return None, 0.0
        assert self.executor is not None
        t0 = time.perf_counter()
        if host is not None:
            key = (host.x.data_ptr(), host.x.shape[0])
            job = self.calls.jobs.get(key)
            if job is None:
                job = self.calls.jobs[key] = _HostJob(self.executor, self.shape.layer, host)
            return job.submit([e if e in on_cpu else -1 for e in flat]), \
                time.perf_counter() - t0
        cpu_ids = torch.from_numpy(np.array([e if e in on_cpu else -1 for e in flat],
                                            dtype=np.int64)).view(ids.shape)
        if x.is_cuda:  # one transfer (one sync) for both
            both = torch.cat([x.float(), w.float()], dim=1).cpu()
            x, w = both[:, :x.shape[1]], both[:, x.shape[1]:]
        return self.executor.submit(x, cpu_ids, w, self.shape.layer), time.perf_counter() - t0

    def _collect(self, future: CpuMoeFuture | None, x: torch.Tensor, overhead: float,
                 host: HostCopies | None = None) -> tuple[torch.Tensor | None, float, float]:
        """The CPU's result on ``x``'s device (left in ``host.cpu_out`` with ``host``), the
        pool's time on it, and the host overhead. On CUDA the result goes through a pinned
        buffer without waiting for the stream (which may still be waiting for the copies): the
        buffer is rewritten only at this layer's next call, after the host has synced on that
        call's routed ids."""
        if future is None:
            return None, 0.0, overhead
        out = future.wait()
        t0 = time.perf_counter()
        if host is None:  # else the pool wrote host.cpu_out, which the graph step copies in
            out = self._to_device(out, x)
        return out, future.seconds, overhead + time.perf_counter() - t0

    def _to_device(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The CPU's result in ``x``'s dtype on its device (through the pinned buffer)."""
        if not x.is_cuda:
            return out.to(dtype=x.dtype)
        T, H = out.shape
        c = self.calls
        if c.staged is None or c.staged.shape[0] < T:
            c.staged = torch.empty(max(T, 16), H, dtype=x.dtype, pin_memory=True)
        staged = c.staged[:T]
        staged.copy_(out)
        return staged.to(x.device, non_blocking=True)

    def _record(self, x: torch.Tensor, hits: dict[int, int], fetched: list[int],
                on_cpu: set[int], fetch: Span | None, compute: Span | None, t_cpu: float,
                overhead: float, plan_s: float = 0.0) -> None:
        rt, bank, layer = self.runtime, self.bank, self.shape.layer
        assert rt is not None and bank is not None
        self.calls.last = (len(on_cpu), t_cpu, len(fetched), fetch, overhead)
        rt.stats.record(layer, x.shape[0], len(hits), len(fetched),
                        len(fetched) * bank.expert_bytes, fetch=fetch, compute=compute,
                        cpu_experts=len(on_cpu), cpu_s=t_cpu, plan_s=plan_s)
        rt.stats.set_fraction(layer, self.policy.fraction)

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
