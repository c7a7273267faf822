"""The MoE plan: every ``auto`` of the MoE flags made concrete, once, before the model is built.

``--moe-strategy auto`` becomes a strategy per layer, ``--moe-cache-auto`` a byte budget,
``--moe-hybrid-max-fetch auto`` and the bandwidth profile a split per hybrid layer, and
``--moe-cpu-threads 0`` a worker count. The result (:class:`MoEPlan`) is frozen and logged;
the runner builds the model from it, makes what its layers need (:attr:`MoEPlan.needs`) and
hands each layer its :class:`~freetoken.moe.strategy.LayerPlan` (``moe/attach.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freetoken.checkpoint import Checkpoint
from freetoken.config import MOE_CPU_SPIN_US, CacheSizing, EngineConfig, human_bytes
from freetoken.cpu import executor as cx
from freetoken.cpu.cores import CorePlan, core_plan, cpu_model, usable_cores
from freetoken.cpu.library import run_isa
from freetoken.errors import ConfigError
from freetoken.kernels.gemv_launch import fused
from freetoken.moe.expert_cache import PoolPlan
from freetoken.moe.host_banks import available_host_bytes, expert_bytes
from freetoken.moe.layer_kind import LayerKind, kind_words, layer_kinds, layer_span
from freetoken.moe.profile import Match, Profile, load_profile_or_empty, lookup, plan_fractions
from freetoken.moe.registry import AUTO, needs_of
from freetoken.moe.resident import keeps_blocks
from freetoken.moe.strategy import ExpertShape, LayerPlan, Needs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoEPlan:
    """What every layer runs and what the model's layers share, nothing left to ``auto``.

    ``layers``: one :class:`LayerPlan` per decoder layer (dense layers: resident).
    ``cache``: the expert cache flag with an ``auto`` budget resolved to bytes (None when no
    layer keeps a device cache). ``pool_threads``: CPU pool workers (0: no pool); ``cores``:
    where they and the engine's other threads run.
    """

    layers: tuple[LayerPlan, ...]
    cache: CacheSizing | None = None
    pool_threads: int = 0
    pool_spin_us: int = MOE_CPU_SPIN_US
    cores: CorePlan | None = None
    lookahead: str = "auto"  # --moe-lookahead: auto (offload layers), on (hybrid too), off

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(p.strategy for p in self.layers)

    @property
    def needs(self) -> Needs:
        out = Needs()
        for name in set(self.strategies):
            out = out | needs_of(name)
        return out


def wants_pool(cfg: EngineConfig) -> bool:
    """Whether the flags may need the CPU pool: a strategy (or one ``auto`` may pick) computes
    experts there, or ``--cpu-dense pool`` puts the dense matrices there."""
    return needs_of(cfg.moe_strategy).cpu_pool or cfg.cpu_dense == "pool"


def plan_moe(cfg: EngineConfig, ckpt: Checkpoint, device: torch.device,
             kv_floor_bytes: int = 0) -> MoEPlan:
    """The plan for ``cfg`` on this machine. ``kv_floor_bytes``: KV memory the experts must
    leave free (``--kv-reserve-tokens``)."""
    mc = ckpt.config
    moe = [i for i, m in enumerate(mc.moe_layers) if m and mc.num_experts]
    cores = core_plan(usable_cores(), wants_pool(cfg), cfg.moe_cpu_threads or None)
    threads = len(cores.workers)
    if cfg.moe_strategy == AUTO:
        strategies = _auto_strategies(cfg, ckpt, device, threads, kv_floor_bytes)
    else:
        strategies = tuple(cfg.moe_strategy if i in moe else "resident"
                           for i in range(mc.num_layers))
    strategies = _without_native(cfg, ckpt, strategies)
    layers = [LayerPlan(s) for s in strategies]
    hybrid = [i for i in moe if strategies[i] == "hybrid"]
    if hybrid:
        _split_hybrid(cfg, ckpt, layers, hybrid, threads)
    needs = MoEPlan(tuple(layers)).needs
    cache = None
    if needs.device_cache:
        cache = cfg.moe_cache
        if cache.kind == "auto":
            budget = _cache_budget(cfg, ckpt, strategies, device, kv_floor_bytes)
            log.info("expert cache budget: %.2f GB free after the weights and %d KV tokens",
                     budget / 1e9, cfg.kv_reserve_tokens)
            cache = CacheSizing.resolved(budget)
    pool = threads if needs.cpu_pool or cfg.cpu_dense == "pool" else 0
    if not pool:
        cores = core_plan(list(cores.usable), False)
    elif cores.shrink_note():
        log.warning("%s", cores.shrink_note())
    plan = MoEPlan(tuple(layers), cache, pool, cfg.moe_cpu_spin_us, cores, cfg.moe_lookahead)
    _log(plan, moe)
    log.info("%s", cores.line())
    return plan


def _without_native(cfg: EngineConfig, ckpt: Checkpoint,
                    strategies: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's layers off the CPU kernels where they cannot run the model's experts (a
    clamped SwiGLU without a positive alpha and limit): an explicit cpu or hybrid is refused,
    auto's choice falls back (cpu -> resident, hybrid -> offload) with a log line."""
    mc = ckpt.config
    why = ExpertShape(0, mc.num_experts, mc.hidden_size, mc.moe_intermediate_size, mc.top_k,
                      mc.hidden_act, mc.expert_bias, mc.swiglu_alpha,
                      mc.swiglu_limit).native_missing()
    native = [s for s in strategies if s in ("cpu", "hybrid")]
    if why is None or not native:
        return strategies
    if cfg.moe_strategy != AUTO:
        raise ConfigError(f"--moe-strategy {cfg.moe_strategy} cannot run {mc.family}'s "
                          f"experts: {why}")
    instead = {"cpu": "resident", "hybrid": "offload"}
    log.info("MoE plan: %s's experts cannot run on the CPU kernels (%s); auto runs %d layers "
             "on %s instead", mc.family, why, len(native),
             " / ".join(sorted({instead[s] for s in native})))
    return tuple(instead.get(s, s) for s in strategies)


def _auto_strategies(cfg: EngineConfig, ckpt: Checkpoint, device: torch.device, threads: int,
                     kv_floor_bytes: int) -> tuple[str, ...]:
    """Resident layers while they fit on the device (and in the cache flag's cap, see
    :func:`resident_budget`), then hybrid, cpu or offload per layer kind from the bandwidth
    profile; on the CPU every MoE layer runs on the CPU pool."""
    mc = ckpt.config
    kinds = layer_kinds(ckpt)
    if device.type != "cuda":
        name = "cpu" if cx.available() is None else "resident"
        return tuple(name if moe else "resident" for moe in mc.moe_layers)
    dense, layer_bytes = _device_bytes(cfg, ckpt)
    moe_bytes = layer_bytes * sum(mc.moe_layers)
    sizing = cfg.moe_cache
    cap = {"mem": sizing.value, "rate": sizing.value * moe_bytes,
           "size": sizing.value * layer_bytes / max(1, mc.num_experts)}.get(sizing.kind)
    free, total = torch.cuda.mem_get_info(device)
    budget = resident_budget(int(free - dense - kv_floor_bytes - 0.05 * total),
                             None if cap is None else int(cap), moe_bytes)
    profile = load_profile_or_empty()

    def recommend(kind: LayerKind) -> str | None:
        if cx.available() is not None:
            row = lookup(profile, kind, threads).row
            return None if row is None else "offload"
        return auto_recommendation(profile, kind, threads, run_isa(), cpu_model(),
                                   cfg.moe_cache)

    return plan_auto(kinds, mc.num_layers, layer_bytes, budget, recommend)


def auto_recommendation(profile: Profile, kind: LayerKind, threads: int, isa: str,
                        cpu: str, cache: CacheSizing | None = None) -> str | None:
    """What ``--moe-strategy auto`` runs layers of ``kind`` as, from the profile row, on a box
    with ``threads`` pool workers at ``isa`` on a ``cpu`` with a ``cache`` of experts: the
    row's recommendation, but offload where the row recommends the CPU (hybrid or cpu) and was
    measured unlike this run (another thread count, ISA or CPU); where its decode check was
    made at this cache, the strategy it measured fastest (offload, hybrid or cpu), since auto
    must not pick a plan slower than another on the box it runs on. None when the kind has
    no row."""
    match = lookup(profile, kind, threads)
    if match.row is None:
        return None
    rec = match.row.recommended
    if rec == "offload":
        return rec
    why = match.unlike(threads, isa, cpu)
    if why is not None:
        log.info("--moe-strategy auto: the profile row for %s was measured %s, so it cannot "
                 "say the CPU pays on this box; those layers offload (run `ft bench bw --model "
                 "<checkpoint>` here to let auto weigh %s)", kind_words(kind), why, rec)
        return "offload"
    check = match.row.decode
    if cache is None:
        return rec
    if check is None:
        log.info("--moe-strategy auto: %s runs %s from the profile's GB/s alone; `ft bench bw "
                 "--model <checkpoint> --decode-check <--moe-cache-mem>` decodes both here "
                 "and offloads where offload is faster", kind_words(kind), rec)
        return rec
    if not check.applies(cache):
        log.info("--moe-strategy auto: the decode check of %s was made with a %s expert "
                 "cache, not this run's (%s), so the profile's GB/s decide (%s)",
                 kind_words(kind), human_bytes(check.cache_bytes), cache.describe(), rec)
        return rec
    best = check.fastest()
    if best != rec:
        log.info("--moe-strategy auto: the profile's GB/s recommend %s for %s, but its %s; "
                 "those layers %s", rec, kind_words(kind), check.measured(),
                 "offload" if best == "offload" else f"run {best}")
    return best


def _device_bytes(cfg: EngineConfig, ckpt: Checkpoint) -> tuple[int, int]:
    """Device bytes of the dense weights (dequantised to the compute dtype) and of one MoE
    layer's experts resident: their file's bytes where every expert tensor is in a format
    resident keeps as blocks on a GPU (``moe/resident.py``), else at the compute dtype."""
    mc, size = ckpt.config, getattr(torch, cfg.dtype).itemsize
    dense, blocks, formats = 0, 0, set()
    for t in ckpt.tensor_infos():
        if ".experts." not in t.name:
            dense += math.prod(t.shape)
        elif len(t.shape) >= 2 and not t.name.endswith("_bias"):
            blocks += t.nbytes
            formats.add(t.fmt)
    if formats and fused(tuple(formats)) and keeps_blocks(torch.device("cuda")):
        return dense * size, blocks // max(1, sum(mc.moe_layers))
    return dense * size, 3 * mc.num_experts * mc.hidden_size * mc.moe_intermediate_size * size


def resident_budget(free: int, cap: int | None, moe_bytes: int) -> int:
    """Device bytes ``--moe-strategy auto`` may give resident expert layers. ``free``: what the
    device has after the dense weights, the KV floor and a margin; ``moe_bytes``: every MoE
    layer resident at the compute dtype. Without a cache flag (``cap`` None) layers go resident
    while they fit in ``free``. A cache flag caps all expert memory, resident layers included:
    every layer goes resident when they all fit in the cap (and in ``free``), else none does and
    the whole cap is the cache, whose slots hold experts in their file's format (as resident
    layers kept as blocks do; dequantised ones take more), so a cap the model does not fit in
    serves more experts as cache than as some resident layers."""
    if cap is None:
        return free
    return moe_bytes if moe_bytes <= min(cap, free) else 0


def _split_hybrid(cfg: EngineConfig, ckpt: Checkpoint, layers: list[LayerPlan],
                  hybrid: list[int], threads: int) -> None:
    """Each hybrid layer's split from its kind's profile row: the fetched share, and the cap
    (``--moe-hybrid-max-fetch``; auto caps only layers without a row)."""
    kinds = {k: [i for i in ids if i in hybrid] for k, ids in layer_kinds(ckpt).items()}
    kinds = {k: ids for k, ids in kinds.items() if ids}
    matches: dict[int, Match] = plan_fractions(load_profile_or_empty(), kinds, threads,
                                               str(ckpt.path))
    cap = None if cfg.moe_hybrid_max_fetch == AUTO else int(cfg.moe_hybrid_max_fetch)
    lost = {k: c for k, ids in kinds.items()
            if (c := matches[ids[0]].check_at(cfg.moe_cache)) and c.loses("hybrid")}
    slower = {i for k in lost for i in kinds[k]}
    for i in hybrid:
        m = matches[i]
        layers[i] = LayerPlan("hybrid", m.fraction, cap if m.row else (cap or m.max_fetch),
                              cfg.moe_hybrid_online, m.used or "", i in slower)
    for kind, ids in kinds.items():
        p = layers[ids[0]]
        what = (f"at {100 * p.fetch_fraction:.1f} % (row {p.split_from})"
                if p.fetch_fraction is not None else f"at a fetch cap of {p.max_fetch}")
        log.info("MoE plan: hybrid on %d %s layer%s %s%s%s", len(ids), kind_words(kind),
                 "" if len(ids) == 1 else "s", what,
                 ", corrected online" if cfg.moe_hybrid_online else "",
                 "; a step with a greedy request fetches every miss (--moe-hybrid-greedy)"
                 if cfg.moe_hybrid_greedy == "fetch" else "")
        if (check := lost.get(kind)) is not None:
            log.warning("--moe-strategy hybrid on %s layers: the profile's %s, so offload "
                        "decodes faster here; %s", kind_words(kind), check.measured(),
                        "the split starts at all-fetch (offload's pace) and the "
                        "wall check tries the model's split now and then; --moe-strategy "
                        "offload runs no check" if cfg.moe_hybrid_online else
                        "--moe-strategy offload (or auto) would run it")


def _cache_budget(cfg: EngineConfig, ckpt: Checkpoint, strategies: tuple[str, ...],
                  device: torch.device, kv_floor_bytes: int, margin: float = 0.05) -> int:
    """Bytes ``--moe-cache-auto`` gives the expert cache: the device memory the weights will
    leave (dense weights and resident experts at the compute dtype), less
    ``--kv-reserve-tokens`` of KV and a margin for activations; on the CPU, a quarter of the
    host memory the expert banks will leave stands in for the device's."""
    mc = ckpt.config
    if device.type != "cuda":
        return int(max(1, (available_host_bytes() - expert_bytes(ckpt)) // 4 - kv_floor_bytes))
    dense, layer_bytes = _device_bytes(cfg, ckpt)
    resident = sum(1 for s, m in zip(strategies, mc.moe_layers, strict=True)
                   if m and s == "resident")
    free, total = torch.cuda.mem_get_info(device)
    budget = free - dense - resident * layer_bytes - kv_floor_bytes - margin * total
    return int(max(1, budget))


def _log(plan: MoEPlan, moe: list[int]) -> None:
    if not moe:
        return
    counts: dict[str, list[int]] = {}
    for i in moe:
        counts.setdefault(plan.layers[i].strategy, []).append(i)
    parts = [f"{s} on layers {layer_span(ids)}" for s, ids in counts.items()]
    if plan.cache is not None:
        parts.append(f"expert cache {plan.cache.describe()}")
    if plan.pool_threads:
        parts.append(f"CPU pool {plan.pool_threads} workers")
    log.info("MoE plan: %s", "; ".join(parts))


@dataclass(frozen=True)
class ExpertGroup:
    """Offloaded layers whose experts take the same bytes (they share one slot pool)."""

    slot_bytes: int
    layers: tuple[int, ...]
    experts_per_layer: int
    top_k: int = 1  # experts one token routes to in these layers

    @property
    def experts(self) -> int:
        return len(self.layers) * self.experts_per_layer


def plan_moe_cache(sizing: CacheSizing, groups: list[ExpertGroup]) -> list[PoolPlan]:
    """Slots per pool from the cache flag (``auto`` resolved to bytes by :func:`plan_moe`).
    Each pool gets at most one slot per expert of its layers and at least one; a flag too
    small for that is an error."""
    total_bytes = sum(g.slot_bytes * g.experts for g in groups)
    total_experts = sum(g.experts for g in groups)
    if sizing.kind == "mem":
        budget = sizing.value
        slots = [int(budget * g.slot_bytes * g.experts / total_bytes) // g.slot_bytes
                 for g in groups]
    elif sizing.kind == "rate":
        slots = [math.ceil(sizing.value * g.experts) for g in groups]
    elif sizing.kind == "size":
        shares = [sizing.value * g.experts / total_experts for g in groups]
        slots = [int(s) for s in shares]
        by_remainder = sorted(range(len(groups)), key=lambda i: slots[i] - shares[i])
        for i in by_remainder[: int(sizing.value) - sum(slots)]:
            slots[i] += 1
    else:
        raise ConfigError(f"unknown expert cache sizing {sizing.kind!r}")
    plans = []
    for g, n in zip(groups, slots, strict=True):
        if n < 1:
            where = f"one {human_bytes(g.slot_bytes)} expert of layers {layer_span(g.layers)}"
            if sizing.kind == "size":
                least = f"{len(groups)} slots, one per expert size"
            else:  # the budget that gives every pool its first slot
                least = human_bytes(max(total_bytes / h.experts for h in groups))
            what = "the free device memory" if sizing.from_auto else sizing.describe()
            raise ConfigError(
                f"{what} leaves no room for {where}; the expert cache needs at least {least} "
                "(give a larger --moe-cache-mem, --moe-cache-rate or --moe-cache-size, or "
                "lower --kv-reserve-tokens)")
        if n < min(g.top_k, g.experts):
            log.warning(
                "expert cache: %d slot%s for the %s experts of layers %s, fewer than the %d "
                "experts one token routes to: every decode call there streams its experts (no "
                "reuse between calls, no CPU share for hybrid); give at least %d (a larger "
                "--moe-cache-mem, --moe-cache-rate or --moe-cache-size)", n,
                "" if n == 1 else "s", human_bytes(g.slot_bytes), layer_span(g.layers), g.top_k,
                g.top_k)
        plans.append(PoolPlan(g.slot_bytes, min(n, g.experts), g.layers))
    n_slots = sum(p.num_slots for p in plans)
    log.info("resolved moe_cache_size=%d (%s, %.1f %% of %d experts) from %s%s", n_slots,
             human_bytes(sum(p.num_slots * p.slot_bytes for p in plans)),
             100 * n_slots / total_experts,
             total_experts, sizing.describe(),
             "" if len(plans) == 1 else "; pools: " + ", ".join(
                 f"{p.num_slots} x {human_bytes(p.slot_bytes)} for layers "
                 f"{layer_span(p.layers)}" for p in plans))
    return plans


def plan_auto(kinds: dict[LayerKind, list[int]], num_layers: int, layer_bytes: int,
              budget: int, recommend: Callable[[LayerKind], str | None]) -> tuple[str, ...]:
    """``--moe-strategy auto`` per layer: resident while ``layer_bytes`` per layer fit in
    ``budget`` (device bytes for resident experts, :func:`resident_budget`), then per layer
    kind what its profile row recommends (``hybrid``, ``cpu`` or ``offload``), else offload.
    ``recommend(kind)`` returns the row's recommendation or None when the kind has no row."""
    plan = ["resident"] * num_layers
    moe = sorted(layer for layers in kinds.values() for layer in layers)
    fit = max(0, min(len(moe), budget // layer_bytes)) if layer_bytes else len(moe)
    rest = set(moe[fit:])
    unbenched = []
    for kind, layers in kinds.items():
        rec = recommend(kind) if rest & set(layers) else None
        if rest & set(layers) and rec is None:
            unbenched.append(kind)
        for layer in layers:
            if layer in rest:
                plan[layer] = rec or "offload"
    if unbenched:
        log.info("--moe-strategy auto: no bandwidth profile row for %s; those layers offload. "
                 "Run `ft bench bw --model <checkpoint>` to let auto choose hybrid where it is "
                 "faster", ", ".join(k.key(0)[:-3] for k in unbenched))
    counts: dict[str, int] = {}
    for layer in moe:
        counts[plan[layer]] = counts.get(plan[layer], 0) + 1
    log.info("--moe-strategy auto: %s", ", ".join(f"{s} on {n} layer{'s' * (n != 1)}"
                                                  for s, n in counts.items()))
    return tuple(plan)
