"""Continuous batching: admit by KV budget, chunk prefills, decode every running sequence.

Each ``step`` runs one forward that mixes the next prefill chunks (up to ``max_prefill_tokens``
new prompt tokens) with one decode token of every sequence that has finished its prefill, then
samples. A request is admitted only when pages for its prompt plus ``max_tokens`` can be
reserved, so a running sequence never runs out of KV mid-generation (no preemption); requests
that do not fit yet wait in FIFO order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from freetoken.engine.runner import ModelRunner
from freetoken.engine.sample import (
    SamplingParams,
    TokenLogprobs,
    apply_penalties,
    generator,
    sample_rows,
    token_logprobs,
)
from freetoken.engine.watchdog import BETWEEN_STEPS, Watchdog
from freetoken.kvcache.radix import PrefixCache
from freetoken.layers.context import Segment
from freetoken.moe.cpu import host_step_totals


@dataclass
class Sequence:
    """Engine-side state of one request."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is written
    cached: int = 0  # prompt tokens reused from the prefix cache
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass(frozen=True)
class Event:
    """One sampled token (or a finish without one) of a request, sent to the API process."""

    rid: str
    token: int | None
    finish_reason: str | None  # None while running; "stop", "length", "abort", "error"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # the token's and the top ones, when asked for


@dataclass
class StepTimes:
    """Where the engine thread's time in steps went, summed (seconds): admitting and batching
    (``schedule_s``), queueing the forward (``forward_s``; on a GPU the device may still be
    running it), and penalties, sampling and events (``sample_s``, which on a GPU includes the
    wait for the step's logits)."""

    steps: int = 0
    tokens: int = 0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


class Scheduler:
    def __init__(self, runner: ModelRunner, max_running: int = 16,
                 max_prefill_tokens: int = 2048, prefix_cache: bool = True,
                 watchdog: Watchdog | None = None) -> None:
        self.runner = runner
        self.watchdog = watchdog
        self.kv = runner.kv
        self.cache = PrefixCache(self.kv) if prefix_cache else None
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.eos = set(runner.model_config.eos_token_ids)
        self.prefix_hit_tokens = 0
        self.times = StepTimes()

    # -- requests in and out ------------------------------------------------------------------
    def add(self, seq: Sequence) -> Event | None:
        """Queue a request; an immediate error Event if it can never fit."""
        need = len(seq.prompt) + seq.params.max_tokens
        if need > self.runner.max_len or self.runner.pages_for(need) > self.kv.num_pages:
            return Event(seq.rid, None, "error", len(seq.prompt), 0, 0,
                         f"prompt ({len(seq.prompt)} tokens) + max_tokens "
                         f"({seq.params.max_tokens}) exceeds the context of "
                         f"{min(self.runner.max_len, self.kv.num_pages * self.kv.page_size)}")
        seq.generator = generator(seq.params.seed, self.runner.device)
        self.waiting.append(seq)
        return None

    def abort(self, rid: str) -> Event | None:
        for seq in list(self.waiting):
            if seq.rid == rid:
                self.waiting.remove(seq)
                return self._event(seq, None, "abort")
        for seq in self.running:
            if seq.rid == rid:
                self._finish(seq)
                return self._event(seq, None, "abort")
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one engine step ----------------------------------------------------------------------
    def step(self) -> list[Event]:
        t0 = time.perf_counter()
        watch = self.watchdog
        if watch is not None:
            watch.step()
        self._admit()
        if not self.running:
            if watch is not None:
                watch.enter(BETWEEN_STEPS)
            return []
        batch, chunks, budget = [], [], self.max_prefill_tokens
        for seq in self.running:
            if seq.prefilling:
                if budget <= 0:
                    continue
                n = min(budget, len(seq.prompt) - seq.computed)
                budget -= n
                chunks.append(seq.prompt[seq.computed:seq.computed + n])
            else:
                n = 1
                chunks.append([seq.output[-1]])
            batch.append((seq, Segment(seq.pages, seq.computed, n)))
        t1 = time.perf_counter()
        if watch is not None:
            watch.enter("forward")
        self.runner.greedy_step(any(seq.params.greedy for seq, _ in batch))
        logits = self.runner.forward(chunks, [s for _, s in batch])
        t2 = time.perf_counter()
        if watch is not None:
            watch.enter("sample")
        events = []
        decoding = []
        for i, (seq, segment) in enumerate(batch):
            seq.computed += segment.count
            if not seq.prefilling:
                decoding.append(i)
        # each row's penalties, then every row's token with one host copy per kind of draw
        views = [logits[i] for i in decoding]
        rows = [apply_penalties(v, batch[i][0].output, batch[i][0].params)
                for i, v in zip(decoding, views, strict=True)]
        if any(r is not v for r, v in zip(rows, views, strict=True)):
            mat = torch.stack(rows)  # some rows were penalised: a copy of the batch's rows
        else:
            mat = logits if len(decoding) == len(batch) else logits[decoding]
        tokens = sample_rows(mat, [batch[i][0].params for i in decoding],
                             [batch[i][0].generator for i in decoding])
        for i, token in zip(decoding, tokens, strict=True):
            seq, raw = batch[i][0], logits[i]
            seq.output.append(token)
            reason = self._finish_reason(seq, token)
            if reason:
                self._finish(seq)
            lp = seq.params.logprobs
            events.append(self._event(seq, token, reason,
                                      None if lp is None else token_logprobs(raw, token, lp)))
        tm = self.times
        tm.steps += 1
        tm.tokens += len(events)
        tm.schedule_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.sample_s += time.perf_counter() - t2
        if watch is not None:
            watch.enter(BETWEEN_STEPS)
        return events

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output) >= p.max_tokens:
            return "length"
        return None

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            total = self.runner.pages_for(len(seq.prompt) + seq.params.max_tokens)
            # the last prompt token is always computed: its logits give the first output token
            shared = self.cache.match(seq.prompt, (len(seq.prompt) - 1) // self.kv.page_size) \
                if self.cache else []
            need = total - len(shared)
            if need > self.kv.free_pages and self.cache:
                self.cache.evict(need - self.kv.free_pages)
            if need > self.kv.free_pages:
                self.kv.release(shared)
                return
            self.waiting.popleft()
            seq.pages = shared + self.kv.allocate(need)
            seq.cached = seq.computed = len(shared) * self.kv.page_size
            self.prefix_hit_tokens += seq.cached
            self.running.append(seq)

    def _finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.cache:
            self.cache.insert(seq.tokens[:seq.computed], seq.pages)
        self.kv.release(seq.pages)
        seq.pages = []

    def _event(self, seq: Sequence, token: int | None, reason: str | None,
               logprobs: TokenLogprobs | None = None) -> Event:
        return Event(seq.rid, token, reason, len(seq.prompt), seq.cached, len(seq.output),
                     logprobs=logprobs)

    def stats(self) -> dict[str, Any]:
        used = self.kv.num_pages - self.kv.free_pages
        out: dict[str, Any] = {
            "running": len(self.running), "waiting": len(self.waiting),
            "kv_pages_total": self.kv.num_pages, "kv_pages_used": used,
            "kv_usage": used / self.kv.num_pages,
            "prefix_cache_pages": self.cache.cached_pages if self.cache else 0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "times": asdict(self.times),
        }
        if self.watchdog is not None:
            out["watchdog"] = self.watchdog.state
        if self.runner.offload is not None:
            out["moe"] = self.runner.offload.stats.snapshot()
        if self.runner.cpu_layers:
            out["cpu_pool"] = host_step_totals(self.runner.cpu_layers)
        return out
