"""``ft serve``: resolve the config, start the engine process, run uvicorn until told to stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from freetoken.errors import ConfigError, FreeTokenError

HOST, PORT = "127.0.0.1", 1919  # where `ft serve` listens by default, and `ft ctl` asks

log = logging.getLogger("freetoken.serve")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from freetoken.checkpoint import open_checkpoint
    from freetoken.engine.resolve import resolve_engine
    from freetoken.server.app import create_app
    from freetoken.server.auth import load_keys
    from freetoken.server.parsers import parser_family
    from freetoken.server.process import EngineClient, ServeConfig
    from freetoken.server.stacks import dump_on_signal
    from freetoken.server.state import ServerState

    for flag in ("max_running_requests", "max_prefill_length", "page_size",
                 "max_queued_requests"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.shutdown_timeout < 0:
        raise ConfigError("--shutdown-timeout must be at least 0")
    try:
        parser_family(None, args.output_parser)
    except ConfigError as e:
        raise ConfigError(f"--output-parser: {e}") from None
    keys = load_keys(args.api_key, args.api_key_file)
    if not keys and not _is_loopback(args.host):
        log.warning("listening on %s without an API key: anyone who can reach it can use the "
                    "model; pass --api-key KEY (or --api-key-file FILE)", args.host)
    _check_port(args.host, args.port)
    engine = resolve_engine(args)
    ckpt = open_checkpoint(engine.model)  # fails fast on a bad checkpoint, before any process
    family = parser_family(ckpt.config.family, args.output_parser)
    log.info("output parser: %s (%s)", family, "--output-parser" if args.output_parser
             else f"the checkpoint's architecture, {ckpt.config.family}")
    template = ckpt.chat_template
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file():
            raise ConfigError(f"--chat-template {path} does not exist")
        template = path.read_text()
    tokenizer = ckpt.tokenizer()
    cfg = ServeConfig(engine=engine, max_running=args.max_running_requests,
                      max_prefill_tokens=args.max_prefill_length, page_size=args.page_size,
                      kv_tokens=args.kv_tokens, prefix_cache=not args.no_prefix_cache,
                      watchdog_s=args.watchdog_s)
    log.info("starting the engine process: max_running_requests=%d max_prefill_length=%d "
             "page_size=%d kv_tokens=%s prefix_cache=%s chat_template=%s",
             cfg.max_running, cfg.max_prefill_tokens, cfg.page_size, cfg.kv_tokens or "auto",
             cfg.prefix_cache, "yes" if template else "none")
    client = EngineClient(cfg)
    try:
        info = client.wait_ready()
    except RuntimeError as e:
        client.shutdown()
        raise FreeTokenError(str(e)) from e
    log.info("engine ready: %d KV tokens, context %d, weights loaded in %.1f s; CUDA graphs: %s",
             info["kv_tokens"], info["max_len"], info["load_s"],
             f"decode batch sizes up to {engine.cuda_graph_max_bs}"
             if engine.cuda_graph_max_bs else "off (eager)")
    name = args.served_model_name or ckpt.path.name
    state = ServerState(client=client, tokenizer=tokenizer, model_name=name,
                        max_len=info["max_len"], chat_template=template,
                        max_queued=args.max_queued_requests, parser_family=family,
                        end_token_ids=frozenset(ckpt.config.eos_token_ids))
    app = create_app(state, keys)
    # uvicorn's own grace period only backs ours up: at --shutdown-timeout every request still
    # in flight is ended with a response of its own (end_all), so uvicorn never has to cancel one
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 10)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    failed = False

    def engine_died() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    client.on_death.append(engine_died)

    def stop(sig: signal.Signals) -> None:
        """SIGINT/SIGTERM: refuse new requests, let those in flight finish up to
        --shutdown-timeout, then end each with a response; a second signal ends them now."""
        loop = asyncio.get_running_loop()
        if state.draining:
            log.info("received %s again: ending %d requests now", sig.name, state.end_all())
            return
        state.draining, server.should_exit = True, True
        log.info("received %s, shutting down: %d requests in flight get up to %g s to finish "
                 "(--shutdown-timeout)", sig.name, len(client.queues), args.shutdown_timeout)

        def grace_over() -> None:
            if client.queues:
                log.warning("shutdown timeout: ending %d requests still in flight",
                            state.end_all())

        loop.call_later(args.shutdown_timeout, grace_over)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)
        client.start_reader(loop)
        try:
            await server.startup()
        except SystemExit:  # uvicorn exits when it cannot bind
            server.should_exit = True
        if server.should_exit:
            raise FreeTokenError(f"cannot listen on {args.host}:{args.port}")
        log.info("API server is ready to serve on %s:%d (model %s%s)", args.host, args.port,
                 name, f", {len(keys)} API keys" if keys else "")
        await server.main_loop()
        await server.shutdown()

    dump_on_signal()  # SIGUSR1: every thread's stack to the log, as in the engine process

    try:
        asyncio.run(main())
    finally:
        client.shutdown()
    if failed:
        log.error("exiting because the engine process failed: %s", client.dead)
        return 1
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port(host: str, port: int) -> None:
    """Fail before loading anything when the address is taken."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}); "
                              "pick another --port or stop what is using it") from e
