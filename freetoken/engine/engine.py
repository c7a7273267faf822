"""``ft generate``'s engine: one request at a time through the model runner.

The server's scheduler (engine/scheduler.py) drives the same runner with many sequences.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from freetoken.config import EngineConfig
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.engine.detok import Detokenizer
from freetoken.engine.resolve import configure_threads, resolve_engine
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sample import SamplingParams, generator, sample
from freetoken.errors import FreeTokenError
from freetoken.layers.context import Segment


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
    """A runner with a KV pool of ``cfg.max_seq_len`` tokens, and the model's tokenizer."""

    def __init__(self, cfg: EngineConfig, progress: bool = True,
                 pool: CpuMoeExecutor | None = None) -> None:
        self.runner = ModelRunner(cfg, kv_tokens=cfg.max_seq_len, progress=progress, pool=pool)
        self.model_config = self.runner.model_config
        self.model = self.runner.model
        self.max_len = self.runner.max_len
        self.device = self.runner.device
        self.tokenizer = self.runner.ckpt.tokenizer()
        self._pages = self.runner.kv.allocate(self.runner.kv.free_pages)

    def forward(self, ids: list[int], start: int) -> torch.Tensor:
        """Run ``ids`` at positions start.. and return the last position's logits (vocab,)."""
        return self.runner.forward([ids], [Segment(self._pages, start, len(ids))])[0]

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
        gen = generator(params.seed, self.runner.device)
        eos = set(self.model_config.eos_token_ids)
        limit = min(params.max_tokens, budget)
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids, 0)
        pos = len(prompt_ids)
        t_decode = t0
        for i in range(limit):
            token = sample(logits, params, gen)
            if i == 0:
                t_decode = time.perf_counter()
                stats.prefill_s = t_decode - t0
            stats.output_tokens += 1
            if on_token:
                on_token(token)
            yield token
            if token in eos or i + 1 == limit:
                break
            logits = self.forward([token], pos)
            pos += 1
        if stats.output_tokens > 1:
            stats.decode_s = time.perf_counter() - t_decode


def generate_main(args: argparse.Namespace) -> int:
    """`ft generate`: one prompt, its tokens streamed to stdout (``--ids``: the token ids),
    then a line of timings and, with offloaded experts, the cache's figures on stderr."""
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    try:
        params.validate()
    except ValueError as e:
        raise FreeTokenError(str(e)) from e
    cfg = resolve_engine(args)
    configure_threads(cfg, pin=True)  # this process runs one engine: off the pool's cores
    engine = Engine(cfg, progress=sys.stderr.isatty())
    ids = engine.encode(args.prompt)
    detok = Detokenizer(engine.tokenizer)
    stats = GenerationStats()
    out = sys.stdout
    if not args.ids:
        out.write(args.prompt)
        out.flush()
    t0 = time.perf_counter()
    try:
        tokens = engine.generate(
            ids,
            params,
            stats=stats,
            on_token=None if args.ids else (lambda t: (out.write(detok.push(t)), out.flush())),
        )
    except ValueError as e:
        raise FreeTokenError(str(e)) from e
    if args.ids:
        print(" ".join(map(str, tokens)))
    else:
        out.write("\n")
    total = time.perf_counter() - t0
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.output_tokens} output tokens; "
        f"prefill {stats.prefill_s:.2f} s, decode {stats.decode_tokens_per_s:.1f} tokens/s, "
        f"total {total:.2f} s]",
        file=sys.stderr,
    )
    if engine.runner.offload is not None:
        moe = engine.runner.offload.stats.snapshot(per_layer=False)
        print(f"[expert cache: hit rate {100 * moe['hit_rate']:.1f} %, "
              f"{moe['bytes_per_token'] / 1e6:.2f} MB/token fetched, {moe['streamed']} experts "
              f"streamed; fetch {moe['fetch_s']:.2f} s, expert compute {moe['compute_s']:.2f} s]",
              file=sys.stderr)
    return 0
