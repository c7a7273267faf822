"""Giving a loaded model's MoE layers what their plan and their strategies' needs call for.

The runner makes the CPU pool (when :attr:`MoEPlan.needs` or ``--cpu-dense pool`` asks for
one) and hands it here; this makes the device expert cache that every layer needing one shares
(one slot pool per expert size, sized by the plan's cache flag), then calls each layer's
:meth:`Experts.attach` with its :class:`LayerPlan`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from freetoken import env
from freetoken.config import CacheSizing, human_bytes
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.errors import ConfigError
from freetoken.kernels.gather_gemv import unavailable
from freetoken.kernels.gemv_launch import KERNELS, fused
from freetoken.moe import lookahead
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.expert_cache import ExpertCache
from freetoken.moe.hybrid import HybridExperts
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.pieces import Recorder
from freetoken.moe.plan import ExpertGroup, MoEPlan, plan_moe_cache
from freetoken.moe.resident import ResidentExperts, keeps_blocks
from freetoken.moe.runtime import OffloadRuntime, row_copier
from freetoken.moe.stats import MoEStats
from freetoken.moe.strategy import Experts, Shared

log = logging.getLogger(__name__)


def attach_moe(model: nn.Module, plan: MoEPlan, pool: CpuMoeExecutor | None = None,
               ) -> OffloadRuntime | None:
    """Attach every MoE layer of ``model`` (loaded) to what it needs; returns the shared
    expert cache's runtime, None when no layer keeps one."""
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    cached = [m for m in layers if type(m).NEEDS.device_cache]
    runtime = None
    if cached:
        assert plan.cache is not None, "the plan has no expert cache for its cached layers"
        runtime = _expert_cache(cached, plan.cache)
    recorder: Recorder | None = runtime
    if recorder is None and any(isinstance(m, CpuExperts) and m.device.type == "cuda"
                                for m in layers):
        recorder = Recorder(row_copier(True))
    shared = Shared(pool, runtime, recorder, {} if runtime is None else runtime.splits)
    for m in layers:
        m.attach(plan.layers[m.shape.layer], shared)
    if cached:
        offloaded = [m for m in cached if isinstance(m, OffloadExperts)]
        choose_gpu_kernels(offloaded, offloaded[0].device)
        if plan.lookahead != "off":
            n = lookahead.link(model, lambda m: isinstance(m, OffloadExperts))
            hybrid = [m for m in offloaded if isinstance(m, HybridExperts)]
            log.info("look-ahead: %d of %d cached layers fetch the next layer's predicted "
                     "experts while they compute (--moe-lookahead %s)%s", n, len(offloaded),
                     plan.lookahead, "" if not hybrid else
                     f"; hybrid layers {hybrid[0].prefetch:.0%} of the predicted misses, or "
                     "their split's share if more (FREETOKEN_HYBRID_PREFETCH)")
    _log_resident([m for m in layers if isinstance(m, ResidentExperts)])
    return runtime


def _log_resident(layers: list[ResidentExperts]) -> None:
    """One line for resident layers on a GPU: how many keep their file's blocks (fused
    kernels) and how many were dequantised to the compute dtype (and why)."""
    if not layers or layers[0].device.type != "cuda":
        return
    blocks = sorted({k for m in layers if (k := m.in_blocks) is not None})
    n = sum(1 for m in layers if m.in_blocks is not None)
    why = "" if keeps_blocks(layers[0].device) else (
        " (FREETOKEN_GPU_EXPERT_KERNEL=dequant or no triton)")
    log.info("resident experts: %d layer%s kept as blocks read by the fused kernels%s, %d "
             "dequantised to %s%s", n, "" if n == 1 else "s",
             f" ({'; '.join(blocks)})" if blocks else "", len(layers) - n,
             str(layers[0].dtype).split(".")[-1], why)


def _expert_cache(layers: list[Experts], sizing: CacheSizing) -> OffloadRuntime:
    """One cache for ``layers`` (their banks loaded), a slot pool per expert size; logs the
    offload layers and each pool."""
    by_size: dict[int, list[OffloadExperts]] = {}
    for m in layers:
        assert isinstance(m, OffloadExperts) and m.bank is not None, \
            f"layer {m.shape.layer} keeps a device cache without a loaded bank"
        by_size.setdefault(m.bank.expert_bytes, []).append(m)
    groups = [ExpertGroup(size, tuple(m.shape.layer for m in ms), ms[0].shape.num_experts,
                          max(m.shape.top_k for m in ms)) for size, ms in by_size.items()]
    plans = plan_moe_cache(sizing, groups)
    first = next(iter(by_size.values()))[0]
    device: torch.device = first.device
    cache = ExpertCache(plans, {m.shape.layer: m.shape.num_experts
                                for ms in by_size.values() for m in ms}, device)
    stats = MoEStats([m.shape.layer for ms in by_size.values() for m in ms],
                     device.type == "cuda",
                     {m.shape.layer: m.bank.layout.kind for ms in by_size.values() for m in ms
                      if m.bank is not None})
    for size, ms in by_size.items():
        pool = cache.pool(ms[0].shape.layer)
        kind = ms[0].bank.layout.kind if ms[0].bank else "?"
        plain = [m for m in ms if type(m) is OffloadExperts]
        if plain:
            log.info("MoE plan: offload on %d %s layer%s (%s per expert, %d experts each)",
                     len(plain), kind, "" if len(plain) == 1 else "s", human_bytes(size),
                     ms[0].shape.num_experts)
        log.info("expert cache: %d slots of %s shared by %d %s layer%s", pool.num_slots,
                 human_bytes(size), len(ms), kind, "" if len(ms) == 1 else "s")
    return OffloadRuntime(cache, stats, device)


def choose_gpu_kernels(layers: list[OffloadExperts], device: torch.device) -> None:
    """Each layer's GPU compute of cached experts (FREETOKEN_GPU_EXPERT_KERNEL): the fused
    kernels where every projection's format has one and triton imports, else dequantise +
    matmul; logged, with a warning when a layer that could be fused is not for want of
    triton."""
    want = env.gpu_expert_kernel()
    if device.type != "cuda":
        return
    able = [m for m in layers if m.bank is not None and fused(m.bank.layout.formats)]
    reason = unavailable()
    if want == "fused" and (reason or not able):
        why = reason or f"no layer's experts are all in {', '.join(KERNELS)}"
        raise ConfigError(f"FREETOKEN_GPU_EXPERT_KERNEL=fused, but {why}; unset it for auto")
    if want == "auto" and able and reason:
        log.warning("GPU expert kernel: %d layers take the slow path (dequantise + matmul) "
                    "because %s; install triton for the fused kernels", len(able), reason)
    chosen = able if want != "dequant" and reason is None else []
    for m in chosen:
        m.gpu_kernel = "fused"
    kinds = sorted({m.bank.layout.kind for m in chosen if m.bank is not None})
    slow = sorted({"/".join(m.bank.layout.formats) for m in layers
                   if m.bank is not None and m not in chosen})
    log.info("GPU expert kernel: fused gather-GEMV on %d layer%s%s, dequantise + matmul on "
             "%d%s", len(chosen), "" if len(chosen) == 1 else "s",
             f" ({'; '.join(kinds)})" if kinds else "", len(layers) - len(chosen),
             f" ({'; '.join(slow)}: no fused kernel)" if slow and reason is None
             and want != "dequant" else "")
