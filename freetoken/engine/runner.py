"""The model runner: builds and loads the model, owns the KV pool, runs one batched forward."""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from freetoken import env
from freetoken.checkpoint import Checkpoint, open_checkpoint
from freetoken.config import EngineConfig
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.engine.graph import DecodeGraphs
from freetoken.kvcache.paged import PagedKV
from freetoken.layers.block_linear import use_block_linears
from freetoken.layers.context import ForwardContext, Segment
from freetoken.layers.pool_linear import PoolLinear, place_pool_linears, use_pool_linears
from freetoken.models import build_model
from freetoken.models.loader import load_weights
from freetoken.models.native_decode import attach_native_decode
from freetoken.moe.attach import attach_moe
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.host_banks import check_host_memory, expert_bytes
from freetoken.moe.plan import MoEPlan, plan_moe

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV pool and the CPU pool. Called from the engine thread only.

    ``pool``: a CPU pool to use instead of making one (several runners in one process, as a
    benchmark has, must not pin two pools to the same cores)."""

    def __init__(self, cfg: EngineConfig, kv_tokens: int | None = None, page_size: int = 64,
                 progress: bool = True, ckpt: Checkpoint | None = None,
                 pool: CpuMoeExecutor | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        self.ckpt = ckpt or open_checkpoint(cfg.model)
        self.model_config = mc = self.ckpt.config
        self.moe: MoEPlan = plan_moe(cfg, self.ckpt, self.device, self._kv_floor_bytes())
        needs = self.moe.needs
        self.pool = pool
        if self.pool is None and self.moe.pool_threads:
            self.pool = CpuMoeExecutor(threads=self.moe.pool_threads,
                                       spin_us=self.moe.pool_spin_us)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = build_model(mc, self.moe.strategies, cfg.max_seq_len)
        finally:
            torch.set_default_dtype(prev)
        if cfg.cpu_dense == "pool":
            assert self.pool is not None, "--cpu-dense pool without a CPU pool in the plan"
            swapped = use_pool_linears(self.model, self.pool)
            routers = sum(isinstance(m, PoolLinear) and m.exact for m in self.model.modules())
            log.info("dense layers on the CPU pool: %d matrices in their checkpoint format, "
                     "%d routers in float32", swapped - routers, routers)
        if self.device.type == "cuda" and env.gpu_dense() == "blocks":
            log.info("dense Q8_0 matrices on the GPU as blocks: %d",
                     use_block_linears(self.model, self.ckpt))
        if needs.host_banks:
            check_host_memory(expert_bytes(self.ckpt))
        load_weights(self.model, self.ckpt, self.device, progress)
        self.model.eval()
        if cfg.cpu_dense == "pool":
            place_pool_linears(self.model)
        if self.pool is not None and cfg.cpu_dense == "pool" and self.device.type == "cpu" \
                and self.dtype == torch.float32:
            native = attach_native_decode(self.model, self.pool)
            log.info("CPU decode: %d of %d layers as one native call each", native,
                     mc.num_layers)
        self.offload = attach_moe(self.model, self.moe, self.pool)
        self.cpu_layers = [m for m in self.model.modules() if isinstance(m, CpuExperts)]
        self.load_s = time.perf_counter() - t0
        self.max_len = min(cfg.max_seq_len, mc.max_position)
        tokens = kv_tokens or self._kv_tokens_from_free_memory()
        self.page_size = page_size
        self.kv = PagedKV(mc.num_layers, math.ceil(tokens / page_size), page_size,
                          *mc.kv_shape, self.dtype, self.device)
        windows = {0} | ({mc.sliding_window} if any(mc.sliding_layers) else set())
        self.windows = tuple(sorted(windows))
        self.graphs: DecodeGraphs | None = None
        if cfg.cuda_graph_max_bs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self.model, self.kv, self.max_len, self.windows,
                                       cfg.cuda_graph_max_bs, self.device)
        log.info("loaded %s (%s, %d layers) on %s in %s in %.1f s; KV pool %d pages x %d tokens",
                 self.ckpt.path.name, mc.family, mc.num_layers, cfg.device, cfg.dtype,
                 self.load_s, self.kv.num_pages, page_size)

    def _kv_floor_bytes(self) -> int:
        """Bytes of ``--kv-reserve-tokens`` KV tokens, which expert memory must leave free."""
        mc = self.model_config
        return self.cfg.kv_reserve_tokens * PagedKV.bytes_per_token(
            mc.num_layers, *mc.kv_shape, self.dtype)

    def _kv_tokens_from_free_memory(self, fraction: float = 0.85) -> int:
        """KV tokens that fit in ``fraction`` of the GPU memory left after the weights
        (of a quarter of the host's available memory on the CPU), at least one full context."""
        mc = self.model_config
        per_token = PagedKV.bytes_per_token(mc.num_layers, *mc.kv_shape, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * fraction
        else:
            budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 4
        tokens = max(self.max_len, int(budget // per_token))
        log.info("KV pool sized from free %s memory: %d tokens (%.2f GB)", self.device.type,
                 tokens, tokens * per_token / 1e9)
        return tokens

    def _split_mixed(self, tokens: list[list[int]],
                     segments: list[Segment]) -> torch.Tensor | None:
        """A step that mixes decode tokens with prefill chunks, on the CPU, as two forwards:
        the decode tokens through the decode path (native layers, decode attention), the
        chunks through prefill's. In one forward a decode token takes prefill's path, whose
        bits differ (the int8 activations amplify it), so a greedy request's text would depend
        on whether another request's prompt arrived during its decode. None: not mixed."""
        decode = [i for i, s in enumerate(segments) if s.count == 1 and s.start > 0]
        if not decode or len(decode) == len(segments):
            return None
        rest = sorted(set(range(len(segments))) - set(decode))
        out: list[torch.Tensor | None] = [None] * len(segments)
        for part in (decode, rest):
            logits = self.forward([tokens[i] for i in part], [segments[i] for i in part])
            for row, i in enumerate(part):
                out[i] = logits[row]
        return torch.stack(out)  # type: ignore[arg-type]

    def greedy_step(self, greedy: bool) -> None:
        """Whether the next forwards' batches hold a greedy sequence: with
        ``--moe-hybrid-greedy fetch`` (the default) hybrid layers then fetch every miss, so a
        greedy request's text does not move with the times hybrid's split measures."""
        if self.offload is not None:
            self.offload.fetch_every_miss(greedy and self.cfg.moe_hybrid_greedy == "fetch")

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
        if self.device.type == "cpu" and not all_logits:
            split = self._split_mixed(tokens, segments)
            if split is not None:
                return split
        if self.pool is not None and self.cfg.cpu_dense == "pool":
            # the same kernels for a request whatever shares its step: a prompt's chunks
            # through the batched kernels however short, decode tokens through the row kernels
            decode = all(s.count == 1 and s.start > 0 for s in segments)
            self.pool.set_batch_from(0 if decode else 1)
        flat = [t for seq in tokens for t in seq]
        ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        ctx = ForwardContext.build(self.kv, segments, self.device, self.windows, all_logits)
        return self.model(ids, ctx)

