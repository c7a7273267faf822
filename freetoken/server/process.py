"""The engine process and the API process's handle on it.

The engine loop runs in its own process (no GIL shared with HTTP handling) and talks over two
multiprocessing pipes: requests and aborts in, batches of token events out. The loop blocks on
the inbound pipe when it has nothing to do, so an idle server uses no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from freetoken.config import EngineConfig
from freetoken.engine.sample import SamplingParams
from freetoken.engine.scheduler import Event, Scheduler, Sequence
from freetoken.engine.watchdog import IDLE, Watchdog
from freetoken.server.stacks import StackResponder, dump_on_signal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """Scheduler and KV settings of the engine process (resolved, frozen)."""

    engine: EngineConfig
    max_running: int
    max_prefill_tokens: int
    page_size: int
    kv_tokens: int
    prefix_cache: bool = True
    stats_interval_s: float = 0.5
    log_interval_s: float = 10.0
    watchdog_s: float = 60.0  # 0: no watchdog


def decode_line(tokens_per_s: float, stats: dict[str, Any],
                before: dict[str, Any] | None = None) -> str:
    """The periodic engine log line: throughput, batch, KV; with offloaded experts the cache
    hit rate (and the share of routed experts look-ahead predicted), the bytes each token
    moved host -> device; and where a decode token's time
    went since ``before`` (the stats at the previous line): the engine thread's step split into
    scheduling, queueing the forward and sampling (which waits for the device), and within the
    forward the experts' fetch, device compute, CPU share and host plan, in ms per token (for
    the cpu strategy, its pool's jobs and the host steps around them)."""
    line = (f"engine: {tokens_per_s:.1f} tokens/s, running {stats['running']}, waiting "
            f"{stats['waiting']}, KV {100 * stats['kv_usage']:.0f} %")
    moe = stats.get("moe")
    if moe:
        line += f", expert cache hit rate {100 * moe['hit_rate']:.1f} %"
        if moe.get("lookahead_hit_rate") is not None:
            line += f" (look-ahead predicted {100 * moe['lookahead_hit_rate']:.0f} %)"
        line += f", {moe['bytes_per_token'] / 1e6:.1f} MB/token fetched"
    times, was = stats.get("times"), (before or {}).get("times") or {}
    if times:
        tokens = times["tokens"] - was.get("tokens", 0)
        if tokens > 0:
            parts = {k: _ms(times, was, f"{k}_s", tokens)
                     for k in ("schedule", "forward", "sample")}
            line += (f"; per token {sum(parts.values()):.1f} ms: schedule "
                     f"{parts['schedule']:.1f}, forward {parts['forward']:.1f}, sample + wait "
                     f"{parts['sample']:.1f}")
            if moe:
                line += experts_part(moe, (before or {}).get("moe"), tokens)
            line += cpu_pool_part(stats.get("cpu_pool"), (before or {}).get("cpu_pool"),
                                  tokens)
    return line


def experts_part(moe: dict[str, Any], was: dict[str, Any] | None, tokens: int) -> str:
    """The offloaded experts' share of a token since ``was`` (the MoE stats then), in ms: the
    fetch, the device's compute, the CPU's share and the host plan, and by layer kind where
    there are several (their expert formats)."""
    old = was or {}

    def shares(d: dict[str, Any], o: dict[str, Any]) -> str:
        return ", ".join(f"{name} {_ms(d, o, key, tokens):.1f}" for name, key in (
            ("fetch", "fetch_s"), ("compute", "compute_s"), ("CPU", "cpu_s"),
            ("host plan", "plan_s")))

    line = f" (experts: {shares(moe, old)})"
    kinds, was_kinds = moe.get("kinds") or {}, old.get("kinds") or {}
    if len(kinds) > 1:  # which layers the time goes to, by their expert formats
        line += "; by layer kind: " + "; ".join(
            f"{kind} ({k['layers']:.0f} layers) {shares(k, was_kinds.get(kind, {}))}"
            for kind, k in sorted(kinds.items()))
    return line


def _ms(d: dict[str, Any], old: dict[str, Any], key: str, tokens: int) -> float:
    """Milliseconds a token of counter ``key`` since ``old``."""
    return 1e3 * (d.get(key, 0.0) - old.get(key, 0.0)) / tokens


def cpu_pool_part(pool: dict[str, Any] | None, was: dict[str, Any] | None,
                  tokens: int) -> str:
    """The cpu strategy's share of a token, where its layers ran between graph pieces: the
    pool's jobs and the host steps around them (ms per token); empty where no such step ran
    since ``was``."""
    was = was or {}
    calls = (pool or {}).get("calls", 0) - was.get("calls", 0)
    if not pool or calls <= 0:
        return ""
    return (f"; CPU pool: jobs {_ms(pool, was, 'job_s', tokens):.1f} ms, host steps "
            f"{_ms(pool, was, 'step_s', tokens):.1f} ms a token")


def engine_main(cfg: ServeConfig, inbox: Connection, outbox: Connection,
                stacks: Connection | None = None) -> None:
    """Entry point of the engine process. ``stacks``: where the API process asks for this
    process's thread stacks (answered from a thread of its own)."""
    from freetoken.engine.resolve import configure_threads
    from freetoken.engine.runner import ModelRunner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")
    # the API process owns shutdown (it drains requests first, then sends "shutdown"); a
    # Ctrl-C or a SIGTERM to the whole process group must not kill the engine under it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dump_on_signal()
    responder = StackResponder(stacks, "engine process") if stacks is not None else None
    send_lock = threading.Lock()  # the engine thread and the watchdog's both send

    def send(message: tuple[str, Any]) -> None:
        with send_lock:
            outbox.send(message)

    try:
        configure_threads(cfg.engine, pin=True)
        runner = ModelRunner(cfg.engine, kv_tokens=cfg.kv_tokens, page_size=cfg.page_size,
                             progress=False)
        watch = (Watchdog(cfg.watchdog_s, interval_s=min(1.0, cfg.watchdog_s / 2),
                          on_change=lambda s: send(("watchdog", s)))
                 if cfg.watchdog_s > 0 else None)
        sched = Scheduler(runner, cfg.max_running, cfg.max_prefill_tokens, cfg.prefix_cache,
                          watch)
        if responder is not None and runner.pool is not None:
            responder.native = runner.pool.describe_workers
    except Exception as e:  # the API process reports it and exits non-zero
        outbox.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    send(("ready", {"pid": os.getpid(),
                           "kv_tokens": runner.kv.num_pages * runner.kv.page_size,
                           "max_len": runner.max_len, "load_s": runner.load_s}))
    last_stats = 0.0
    last_log, decoded, logged = time.monotonic(), 0, sched.stats()
    fresh = False  # the API process has the stats of the last step (none yet: sent idle)
    while True:
        # block only when idle: a busy engine drains the pipe without waiting
        if not sched.has_work():
            if not fresh:  # the stats as they ended, before waiting for more work
                send(("events", ([], sched.stats())))
                fresh = True
            if watch is not None:
                watch.enter(IDLE)
            inbox.poll(None)
        events: list[Event] = []
        while inbox.poll(0):
            kind, payload = inbox.recv()
            if kind == "shutdown":
                return
            if kind == "add":
                rid, prompt, params = payload
                err = sched.add(Sequence(rid, prompt, params))
                if err:
                    events.append(err)
            elif kind == "abort":
                ev = sched.abort(payload)
                if ev:
                    events.append(ev)
        try:
            events += sched.step()
        except Exception:
            send(("fatal", traceback.format_exc()))
            return
        now = time.monotonic()
        stats = None
        if now - last_stats > cfg.stats_interval_s:
            stats, last_stats = sched.stats(), now
        decoded += sum(1 for e in events if e.token is not None)
        if now - last_log > cfg.log_interval_s and decoded:
            current = stats or sched.stats()
            log.info(decode_line(decoded / (now - last_log), current, logged))
            decoded, last_log, logged = 0, now, current
        if events or stats:
            send(("events", (events, stats)))
        fresh = stats is not None


class EngineClient:
    """The API process's side: start the engine, submit, abort, and route events to requests.

    ``submit`` and ``abort`` are called on the asyncio loop's thread; a reader thread turns
    events into per-request asyncio queues.
    """

    def __init__(self, cfg: ServeConfig) -> None:
        ctx = mp.get_context("spawn")
        self._to_engine, engine_in = ctx.Pipe(duplex=False)[::-1]
        engine_out, self._from_engine = ctx.Pipe(duplex=False)[::-1]
        self._stacks, engine_stacks = ctx.Pipe()
        self._stacks_lock = threading.Lock()
        self.proc = ctx.Process(target=engine_main,
                                args=(cfg, engine_in, engine_out, engine_stacks),
                                name="freetoken-engine", daemon=True)
        self.proc.start()
        engine_in.close()
        engine_out.close()
        engine_stacks.close()
        self.queues: dict[str, asyncio.Queue[Event]] = {}
        self.stats: dict[str, Any] = {}
        self.info: dict[str, Any] = {}
        self.dead: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_death: list[Any] = []
        self.closing = False

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine has loaded the model; raise with its error if it failed."""
        try:
            kind, payload = self._from_engine.recv()
        except EOFError:
            raise RuntimeError("the engine process died while loading the model") from None
        if kind != "ready":
            raise RuntimeError(f"the engine failed to start: {payload}")
        self.info = payload
        return payload

    def start_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.loop is not None
        while True:
            try:
                kind, payload = self._from_engine.recv()
            except (EOFError, OSError):
                kind, payload = "fatal", "the engine process exited"
            try:
                if kind == "fatal":
                    if not self.closing:
                        self.loop.call_soon_threadsafe(self._die, str(payload))
                    return
                if kind == "watchdog":  # between stats: the engine thread may be the one stuck
                    self.loop.call_soon_threadsafe(self._watchdog, payload)
                    continue
                events, stats = payload
                self.loop.call_soon_threadsafe(self._dispatch, events, stats)
            except RuntimeError:  # the event loop has closed: the server is shutting down
                return

    def _dispatch(self, events: list[Event], stats: dict[str, Any] | None) -> None:
        if stats:
            self.stats = stats
        for e in events:
            q = self.queues.get(e.rid)
            if q is not None:
                q.put_nowait(e)

    def _watchdog(self, state: dict[str, Any]) -> None:
        self.stats = {**self.stats, "watchdog": state}

    def _die(self, reason: str) -> None:
        self.dead = reason
        log.error("engine process failed: %s", reason)
        for rid, q in self.queues.items():
            q.put_nowait(Event(rid, None, "error", 0, 0, 0, "the engine process failed"))
        for callback in self.on_death:
            callback()

    def engine_stacks(self, timeout: float = 5.0) -> str:
        """The engine process's thread stacks (blocks up to ``timeout``; call off the loop)."""
        with self._stacks_lock:
            if not self.proc.is_alive():
                return "engine process: not running"
            try:
                self._stacks.send("stacks")
                if not self._stacks.poll(timeout):
                    return f"engine process: no answer in {timeout:g} s"
                return str(self._stacks.recv())
            except (EOFError, OSError) as e:
                return f"engine process: {type(e).__name__}: {e}"

    def submit(self, rid: str, prompt: list[int], params: SamplingParams) -> asyncio.Queue[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        self.queues[rid] = q
        self._to_engine.send(("add", (rid, prompt, params)))
        return q

    def abort(self, rid: str) -> None:
        if self.queues.pop(rid, None) is not None and not self.dead:
            self._to_engine.send(("abort", rid))

    def done(self, rid: str) -> None:
        self.queues.pop(rid, None)

    def shutdown(self) -> None:
        self.closing = True
        if self.proc.is_alive():
            try:
                self._to_engine.send(("shutdown", None))
            except OSError:
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.terminate()
