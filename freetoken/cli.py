"""The ``ft`` command: argparse only; everything else is built from the frozen config."""

from __future__ import annotations

import argparse
import logging
import sys

from freetoken import __version__, env
from freetoken.config import KV_RESERVE_TOKENS, MOE_CPU_SPIN_US
from freetoken.engine.resolve import DEVICES, DTYPES
from freetoken.errors import FreeTokenError
from freetoken.server.serve import HOST, PORT

log = logging.getLogger("freetoken")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that loads a model."""
    from freetoken.moe.registry import strategy_names

    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="Hugging Face model directory or .gguf file "
        "(default: the embedded Gemma-3 270M Q4_K_M GGUF)",
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=DEVICES,
        help="where the model runs (auto: cuda if a GPU is visible, else cpu)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="compute dtype (auto: bfloat16 on cuda, float32 on cpu)",
    )
    g.add_argument(
        "--moe-strategy",
        default="resident",
        choices=["auto", *strategy_names()],
        help="where MoE experts live and how a miss is served: resident (all on the device), "
        "offload (host RAM + a device expert cache, misses fetched), cpu (computed on the "
        "CPU), hybrid (misses split between fetch and CPU), auto (per layer: resident while "
        "it fits, then what the `ft bench bw` profile recommends, else offload; a "
        "--moe-cache-* flag caps all expert memory, resident layers included)",
    )
    g.add_argument(
        "--max-seq-len",
        type=int,
        default=4096,
        help="KV cache length in tokens (prompt + output); capped by the model",
    )
    g.add_argument(
        "--moe-cpu-threads",
        type=int,
        default=0,
        help="CPU expert workers for --moe-strategy cpu, each pinned to its own core "
        "(0: one per usable core but the first, which the engine thread keeps)",
    )
    g.add_argument(
        "--moe-cpu-spin-us",
        type=int,
        default=MOE_CPU_SPIN_US,
        metavar="US",
        help="how long an idle CPU worker spins for the next job before it sleeps (bounded; "
        "0: sleep at once). Decode hands the pool one job per layer, a fraction of a "
        "millisecond apart: a spin that outlasts the gap saves a wake-up per job",
    )
    c = g.add_mutually_exclusive_group()
    c.add_argument("--moe-cache-mem", metavar="BYTES",
                   help="expert cache of offloaded layers in bytes, e.g. 4GB or 512MiB")
    c.add_argument("--moe-cache-rate", type=float, metavar="FRACTION",
                   help="expert cache as a fraction of all experts of offloaded layers, e.g. 0.15")
    c.add_argument("--moe-cache-size", type=int, metavar="N", help="expert cache in slots")
    c.add_argument("--moe-cache-auto", action="store_true",
                   help="expert cache from the device memory left after the weights and "
                   "--kv-reserve-tokens of KV (the default)")
    g.add_argument(
        "--kv-reserve-tokens",
        type=int,
        default=KV_RESERVE_TOKENS,
        help="KV tokens --moe-cache-auto leaves room for",
    )
    g.add_argument(
        "--moe-hybrid-max-fetch",
        default="auto",
        metavar="auto|N",
        help="hybrid: fetch at most N of a layer's misses per step, the rest run on the CPU "
        "(auto: the share from the layer's `ft bench bw` row, or 1 without a row)",
    )
    g.add_argument(
        "--moe-hybrid-online",
        default="on",
        choices=("on", "off"),
        help="hybrid: move each layer's fetch share toward the split where CPU and PCIe "
        "finish together, from the times measured while serving",
    )
    g.add_argument(
        "--moe-hybrid-greedy",
        default="fetch",
        choices=("fetch", "split"),
        help="hybrid, in a step whose batch holds a greedy request (temperature 0): fetch "
        "every miss, so that its text is offload's and resident's, bit for bit, whatever the "
        "split has measured (the step runs at offload's speed); split: split as any step "
        "(faster, but the CPU computes an expert in other bits than the GPU, so greedy text can "
        "change from run to run)",
    )
    g.add_argument(
        "--moe-lookahead",
        default="auto",
        choices=("auto", "on", "off"),
        help="while an offloaded layer computes, fetch the experts the next layer's router "
        "picks for its input into the cache (outputs are unchanged; a wrong prediction costs "
        "link time; /v1/stats shows its hit rate). auto (or on): offload layers fetch every "
        "predicted miss, hybrid layers 40%% of them or their split's share if that is more "
        "(FREETOKEN_HYBRID_PREFETCH sets the 40%%), so the link works while the CPU does; "
        "off: none",
    )
    g.add_argument(
        "--cpu-dense",
        default="auto",
        choices=("auto", "torch", "pool"),
        help="--device cpu: dense layers (attention, dense MLPs, an untied head) in torch at "
        "the compute dtype, or in their checkpoint format on the CPU MoE pool's kernels "
        "(pool: fewer bytes per token and every pool core; activations rounded to int8/bf16 "
        "as the expert kernels do; MoE routers stay float32 on the pool). auto: pool with "
        "--moe-strategy auto or cpu, or a dense model, where the CPU library loads; else "
        "torch",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=16,
        help="capture decode steps as CUDA graphs for batch sizes up to this "
        "(0: eager; on the CPU always eager)",
    )


def _generate(args: argparse.Namespace) -> int:
    from freetoken.engine.engine import generate_main

    return generate_main(args)


def _serve(args: argparse.Namespace) -> int:
    from freetoken.server.serve import serve

    return serve(args)


def _chat(args: argparse.Namespace) -> int:
    from freetoken.server.chat import chat_main

    return chat_main(args)


def _ctl(args: argparse.Namespace) -> int:
    from freetoken.server.ctl import ctl_main

    return ctl_main(args)


def _synth(args: argparse.Namespace) -> int:
    from freetoken.checkpoint.synth import synth_main

    return synth_main(args)


def _bench_bw(args: argparse.Namespace) -> int:
    from freetoken.bench.bw import bench_bw_main

    return bench_bw_main(args)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default."""


def build_parser() -> argparse.ArgumentParser:
    from freetoken.server.parsers import parser_names

    p = argparse.ArgumentParser(
        prog="ft",
        description="FreeToken: serve MoE LLMs on one machine "
        "whose GPU is too small for the model.",
    )
    p.add_argument("--version", action="version", version=f"freetoken {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate",
        formatter_class=_Help,
        help="generate text from a prompt on the terminal",
        description="Generate a continuation of --prompt, streamed to stdout; "
        "timings go to stderr.",
    )
    add_engine_args(g)
    s = g.add_argument_group("sampling")
    s.add_argument("--prompt", default="The capital of France is", help="text to continue")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0 = off)")
    s.add_argument("--seed", type=int, default=None, help="seed for sampling")
    s.add_argument("--ids", action="store_true", help="print output token ids instead of text")
    g.set_defaults(func=_generate)

    v = sub.add_parser(
        "serve",
        formatter_class=_Help,
        help="serve the model over OpenAI- and Anthropic-compatible HTTP APIs",
        description="Load the model in an engine process and serve "
        "/v1/chat/completions, /v1/completions (OpenAI), /v1/messages, "
        "/v1/messages/count_tokens (Anthropic), /v1/models, /health, /metrics "
        "and /v1/stats.",
    )
    add_engine_args(v)
    h = v.add_argument_group("server")
    h.add_argument("--host", default=HOST, help="address to listen on")
    h.add_argument("--port", type=int, default=PORT, help="port to listen on")
    h.add_argument("--served-model-name", help="model id clients send (default: file/dir name)")
    h.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template, for models whose checkpoint has none",
    )
    h.add_argument(
        "--output-parser",
        metavar="NAME",
        help="how chat outputs split into reasoning, answer and tool calls: "
        f"{', '.join(parser_names())}, or an architecture name such as qwen3_moe, for a "
        "fine-tune that speaks another family's format; unset: the checkpoint's architecture "
        "picks it (plain for one without markup)",
    )
    h.add_argument(
        "--max-running-requests",
        type=int,
        default=16,
        help="sequences decoded together in one batch",
    )
    h.add_argument(
        "--max-prefill-length",
        type=int,
        default=2048,
        help="prompt tokens prefilled per engine step (longer prompts are chunked)",
    )
    h.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests in flight beyond which new ones get 503",
    )
    h.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require this key on every endpoint but /health, sent as 'Authorization: Bearer "
        "KEY' or 'x-api-key: KEY'; a missing or wrong key gets 401 (repeat for several keys)",
    )
    h.add_argument(
        "--api-key-file",
        action="append",
        metavar="FILE",
        help="as --api-key, one key a line ('#' lines skipped); may be repeated",
    )
    h.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="on SIGTERM/SIGINT, requests in flight get S seconds to finish; then each still "
        "running ends with a 503 (or an error event, if streaming) and the server exits",
    )
    h.add_argument("--page-size", type=int, default=64, help="KV cache page size in tokens")
    h.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="KV pool size in tokens (0: from free memory after the weights). A "
        "request is admitted when pages for its prompt + max_tokens are free; "
        "until then it waits in the queue",
    )
    h.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="do not reuse the KV of shared prompt prefixes",
    )
    h.add_argument(
        "--watchdog-s",
        type=float,
        default=60.0,
        metavar="S",
        help="a step phase that lasts longer than S seconds (or an engine thread burning a "
        "core for 10 s while the CPU pool idles and steps crawl) logs one line naming the "
        "phase and where the engine thread is, and shows in /health and /v1/stats; 0 turns "
        "it off",
    )
    v.set_defaults(func=_serve)

    c = sub.add_parser(
        "chat",
        formatter_class=_Help,
        help="chat in the terminal with a running server",
        description="Stream a conversation from `ft serve` (or start one with --model).",
    )
    c.add_argument("--url", default=f"http://{HOST}:{PORT}", help="server to talk to")
    c.add_argument("--model", help="start `ft serve --model MODEL` instead of using --url")
    c.add_argument("--device", default="auto", choices=DEVICES, help="with --model")
    c.add_argument("--chat-template", metavar="FILE", help="with --model")
    c.add_argument("--system", help="system prompt")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.7)
    c.set_defaults(func=_chat)

    from freetoken.server.ctl import add_ctl_args

    k = sub.add_parser(
        "ctl",
        formatter_class=_Help,
        help="ask a running server for its health, stats or thread stacks",
        description="Ask a running `ft serve` (found by --host/--port): health, stats, or "
        "stacks (every thread's Python stack of its API and engine processes; no ptrace). "
        "SIGUSR1 to either process also writes its stacks to the server's log.",
    )
    add_ctl_args(k)
    k.set_defaults(func=_ctl)

    from freetoken.checkpoint.synth import add_synth_args

    y = sub.add_parser(
        "synth",
        formatter_class=_Help,
        help="write a random-weight checkpoint at a preset geometry",
        description="Write a synthetic checkpoint (HF directory or GGUF) with "
        "random weights at a real model's geometry, for benches and tests.",
    )
    add_synth_args(y)
    y.set_defaults(func=_synth)

    from freetoken.bench.bw import add_bench_bw_args

    b = sub.add_parser(
        "bench",
        help="measure this machine for the engine",
        description="Benches whose results the engine reads at startup.",
    )
    bench = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    w = bench.add_parser(
        "bw",
        formatter_class=_Help,
        help="bench CPU MoE and PCIe gather bandwidth per MoE layer kind",
        description="Bench each MoE layer kind on synthetic expert banks: CPU MoE and PCIe "
        "gather GB/s, each alone and overlapped, one row per kind merged into the bandwidth "
        "profile, which hybrid layers read at startup. Kinds come from --model checkpoints "
        "(no weights are read), --dtype formats and --preset geometries; with none of these, "
        "--dtype all.",
    )
    add_bench_bw_args(w)
    w.set_defaults(func=_bench_bw)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=env.log_level(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except FreeTokenError as e:
        print(f"ft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
