"""The model runner: builds and loads the model, owns the KV pool, runs one batched forward."""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from freetoken.checkpoint import Checkpoint, open_checkpoint
from freetoken.config import EngineConfig
from freetoken.engine.context import ForwardContext, Segment
from freetoken.engine.graph import DecodeGraphs
from freetoken.engine.native_decode import attach_native_decode
from freetoken.kvcache.paged import PagedKV
from freetoken.layers.pool_linear import PoolLinear, use_pool_linears
from freetoken.models import build_model
from freetoken.models.loader import load_weights
from freetoken.moe import cpu_executor
from freetoken.moe.cpu import shared_executor
from freetoken.moe.host_banks import available_host_bytes, check_host_memory, expert_bytes
from freetoken.moe.hybrid import attach_hybrid
from freetoken.moe.offload import attach_offload
from freetoken.moe.profile import LayerKind, layer_kinds, load_profile_or_empty, lookup
from freetoken.moe.strategy import StrategyPlan
from freetoken.resolve import CPU_POOL_STRATEGIES, plan_auto

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model and the KV pool. Called from the engine thread only."""

    def __init__(self, cfg: EngineConfig, kv_tokens: int | None = None, page_size: int = 64,
                 progress: bool = True, ckpt: Checkpoint | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        self.ckpt = ckpt or open_checkpoint(cfg.model)
        self.model_config = mc = self.ckpt.config
        if cfg.moe_strategy in CPU_POOL_STRATEGIES or cfg.cpu_dense == "pool":
            # the first call sizes the process's CPU pool
            shared_executor(threads=cfg.moe_cpu_threads or None, spin_us=cfg.moe_cpu_spin_us)
        self.plan: StrategyPlan = cfg.moe_strategy
        if cfg.moe_strategy == "auto":
            self.plan = self._plan_auto()
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(mc, self.plan)
        finally:
            torch.set_default_dtype(prev)
        if cfg.cpu_dense == "pool":
            swapped = use_pool_linears(self.model)
            routers = sum(isinstance(m, PoolLinear) and m.exact for m in self.model.modules())
            log.info("dense layers on the CPU pool: %d matrices in their checkpoint format, "
                     "%d routers in float32", swapped - routers, routers)
        if any(p in ("offload", "hybrid", "cpu") for p in _names(self.plan)):
            check_host_memory(expert_bytes(self.ckpt))
        load_weights(self.model, self.ckpt, self.device, progress)
        self.model.eval()
        if cfg.cpu_dense == "pool" and self.device.type == "cpu" and self.dtype == torch.float32:
            native = attach_native_decode(self.model)
            log.info("CPU decode: %d of %d layers as one native call each", native,
                     mc.num_layers)
        self.offload = attach_offload(self.model, cfg.moe_cache, self._cache_budget)
        if "hybrid" in _names(self.plan):
            attach_hybrid(self.model, shared_executor().threads,
                          cfg.moe_hybrid_max_fetch or None, cfg.moe_hybrid_online,
                          str(self.ckpt.path))
        self.load_s = time.perf_counter() - t0
        self.max_len = min(cfg.max_seq_len, mc.max_position)
        tokens = kv_tokens or self._kv_tokens_from_free_memory()
        self.page_size = page_size
        self.kv = PagedKV(mc.num_layers, math.ceil(tokens / page_size), page_size,
                          mc.num_kv_heads, mc.head_dim, self.dtype, self.device)
        windows = {0} | ({mc.sliding_window} if any(mc.sliding_layers) else set())
        self.windows = tuple(sorted(windows))
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graph_max_bs and self.device.type == "cuda" and "cpu" not in _names(self.plan):
            self.graphs = DecodeGraphs(self.model, self.kv, self.max_len, self.windows,
                                       cfg.cuda_graph_max_bs, self.device)
        log.info("loaded %s (%s, %d layers) on %s in %s in %.1f s; KV pool %d pages x %d tokens",
                 self.ckpt.path.name, mc.family, mc.num_layers, cfg.device, cfg.dtype,
                 self.load_s, self.kv.num_pages, page_size)

    def _plan_auto(self) -> tuple[str, ...]:
        """Resident layers while they fit on the device, then hybrid or offload per layer kind
        from the bandwidth profile; on the CPU every MoE layer runs on the CPU pool."""
        mc, ckpt = self.model_config, self.ckpt
        kinds = layer_kinds(ckpt)
        if self.device.type != "cuda":
            name = "cpu" if cpu_executor.available() is None else "resident"
            return tuple(name if moe else "resident" for moe in mc.moe_layers)
        size = self.dtype.itemsize
        dense = sum(math.prod(qt.shape) for n, qt in ckpt.tensors() if ".mlp.experts." not in n)
        layer_bytes = 3 * mc.num_experts * mc.hidden_size * mc.moe_intermediate_size * size
        sizing = self.cfg.moe_cache
        cache = {"mem": sizing.value, "rate": sizing.value * layer_bytes * sum(mc.moe_layers),
                 "size": sizing.value * layer_bytes / max(1, mc.num_experts)}.get(sizing.kind, 0)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(free - dense * size - self._kv_floor_bytes() - cache - 0.05 * total)
        profile = load_profile_or_empty()
        threads = shared_executor().threads

        def recommend(kind: LayerKind) -> str | None:
            match = lookup(profile, kind, threads)
            return match.row.recommended if match.row is not None else None

        return plan_auto(kinds, mc.num_layers, layer_bytes, budget, recommend)

    def _cache_budget(self, margin: float = 0.05) -> int:
        """Bytes ``--moe-cache-auto`` may give the expert cache: the device memory left after
        the weights, less ``--kv-reserve-tokens`` of KV and a margin for activations (on the
        CPU, a quarter of the available host memory stands in for the device's)."""
        kv = self._kv_floor_bytes()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - kv - margin * total
        else:
            budget = available_host_bytes() // 4 - kv
        log.info("expert cache budget: %.2f GB free after the weights and %d KV tokens",
                 budget / 1e9, self.cfg.kv_reserve_tokens)
        return int(max(0, budget))

    def _kv_floor_bytes(self) -> int:
        """Bytes of ``--kv-reserve-tokens`` KV tokens, which expert memory must leave free."""
        mc = self.model_config
        return self.cfg.kv_reserve_tokens * PagedKV.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)

    def _kv_tokens_from_free_memory(self, fraction: float = 0.85) -> int:
        """KV tokens that fit in ``fraction`` of the GPU memory left after the weights
        (of a quarter of the host's available memory on the CPU), at least one full context."""
        mc = self.model_config
        per_token = PagedKV.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                            self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * fraction
        else:
            budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4
        tokens = max(self.max_len, int(budget // per_token))
        log.info("KV pool sized from free %s memory: %d tokens (%.2f GB)", self.device.type,
                 tokens, tokens * per_token / 1e9)
        return tokens

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    @torch.inference_mode()
    def forward(self, tokens: list[list[int]], segments: list[Segment],
                all_logits: bool = False) -> torch.Tensor:
        """New tokens of each segment -> float32 logits of each segment's last token (B, V).

        With ``all_logits``, logits of every new token (T, V) instead.
        """
        if self.graphs and not all_logits and self.graphs.fits(segments):
            return self.graphs.run(tokens, segments)
        flat = [t for seq in tokens for t in seq]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        ctx = ForwardContext.build(self.kv, segments, self.device, self.windows, all_logits)
        return self.model(ids, ctx)


def _names(plan: StrategyPlan) -> set[str]:
    return {plan} if isinstance(plan, str) else set(plan)
