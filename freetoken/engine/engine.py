"""The model runner for one sequence: load, prefill, decode, stream.

``Engine.generate`` is the first engine path: one request at a time with a contiguous KV cache.
The server's scheduler (continuous batching, paged KV) builds on the same model forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.config import EngineConfig
from freetoken.engine.context import ForwardContext
from freetoken.engine.sample import SamplingParams, sample
from freetoken.kvcache.contiguous import ContiguousKV
from freetoken.models import build_model
from freetoken.models.loader import load_weights

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.output_tokens - 1  # the first token comes from prefill
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


class Engine:
    """Owns the model, its tokenizer and a KV cache sized for ``cfg.max_seq_len`` tokens."""

    def __init__(self, cfg: EngineConfig, progress: bool = True) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        t0 = time.perf_counter()
        self.ckpt = open_checkpoint(cfg.model)
        self.model_config = mc = self.ckpt.config
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = build_model(mc, cfg.moe_strategy)
            finally:
                torch.set_default_dtype(prev)
        load_weights(self.model, self.ckpt, self.device, progress)
        self.model.eval()
        self.max_len = min(cfg.max_seq_len, mc.max_position)
        self.kv = ContiguousKV(mc.num_layers, self.max_len, mc.num_kv_heads, mc.head_dim,
                               self.dtype, self.device)
        self.tokenizer = self.ckpt.tokenizer()
        log.info("loaded %s (%s, %d layers) on %s in %s in %.1f s", self.ckpt.path.name,
                 mc.family, mc.num_layers, cfg.device, cfg.dtype, time.perf_counter() - t0)

    @torch.inference_mode()
    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ``ids`` at positions start.. and return the last position's logits (vocab,)."""
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        ctx = ForwardContext.for_tokens(self.kv, start, len(ids), self.device)
        return self.model(t, ctx)[-1]

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams,
        on_token: Callable[[int], None] | None = None, stats: GenerationStats | None = None,
    ) -> list[int]:
        """Greedy or sampled continuation of ``prompt_ids``; stops at EOS or max_tokens."""
        return list(self.stream(prompt_ids, params, stats, on_token))

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, stats: GenerationStats | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Iterator[int]:
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        budget = self.max_len - len(prompt_ids)
        if budget < 1:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_len}; "
                "shorten it or raise --max-seq-len"
            )
        stats = stats or GenerationStats()
        stats.prompt_tokens = len(prompt_ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        eos = set(self.model_config.eos_token_ids)
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids, 0)
        pos = len(prompt_ids)
        for i in range(min(params.max_tokens, budget)):
            token = sample(logits, params, gen)
            now = time.perf_counter()
            if i == 0:
                stats.prefill_s = now - t0
                t_decode = now
            stats.output_tokens += 1
            if on_token:
                on_token(token)
            yield token
            if token in eos or i + 1 == min(params.max_tokens, budget):
                break
            logits = self.forward([token], pos)
            pos += 1
        if stats.output_tokens > 1:
            self._sync()
            stats.decode_s = time.perf_counter() - t_decode

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
