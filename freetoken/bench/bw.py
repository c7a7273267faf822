"""``ft bench bw``: bench every MoE layer kind asked for and merge the rows into the profile.

Layer kinds come from checkpoints (``--model``: each opened without reading weights, its kinds
collected by :func:`profile.layer_kinds`), from formats at the canonical shape (``--dtype``) and
from synthetic presets (``--preset``); with none of these, ``--dtype all``. Each kind is benched
with its model's expert activation (the checkpoint's or the preset family's config; silu for
``--dtype``; GPT-OSS's clamped SwiGLU with zero biases) on a synthetic bank (:mod:`bandwidth`)
and becomes one :class:`Row` keyed ``kind.key(threads)``, where threads is the CPU executor's
worker count, resolved as ``ft serve --moe-cpu-threads`` resolves it. Kinds whose experts the
CPU kernels cannot run (a format they lack) are skipped with a warning saying why.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from freetoken import env
from freetoken.bench import bandwidth as bw
from freetoken.bench import decode_run
from freetoken.checkpoint.synth.presets import PRESETS, hf_config, resolve_spec
from freetoken.config import ModelConfig
from freetoken.cpu import executor as cx
from freetoken.cpu.cores import core_plan, cpu_model, usable_cores
from freetoken.engine.resolve import parse_bytes
from freetoken.errors import CheckpointError, ConfigError
from freetoken.moe.decode_check import DecodeCheck
from freetoken.moe.profile import (
    HYBRID_MARGIN,
    LayerKind,
    Row,
    cpu_format,
    format_table,
    layer_kinds,
    profile_path,
    save_rows,
)
from freetoken.quant import FORMATS

log = logging.getLogger(__name__)

CANONICAL = "qwen3-30b-a3b"  # --dtype rows are benched at this preset's shape
PHASES = ("banks", "cpu", "gather", "overlapped")
CPU_STRATEGIES = ("hybrid", "cpu")  # what the decode check weighs against offload
THREADS_HELP = (
    "CPU MoE workers, resolved exactly as `ft serve --moe-cpu-threads` resolves them: 0 is one "
    "worker per usable core (affinity mask and cgroup quota) but the first, which the engine "
    "thread keeps; N is N workers. Rows are keyed t<workers>, so a server finds its rows when "
    "it runs with the same value: leave both at 0, or pass the same N to both"
)


@dataclass
class Target:
    """One layer kind to bench and where it came from."""

    kind: LayerKind
    experts: int  # experts per layer of the model (the bank holds at least this many)
    activation: str  # the model's expert activation (ModelConfig.hidden_act)
    sources: list[str] = field(default_factory=list)
    bias: bool = False  # the experts carry biases (GPT-OSS)


def add_bench_bw_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``ft bench bw``."""
    presets = ", ".join(PRESETS)
    p.add_argument("--model", action="append", metavar="CKPT[,CKPT...]",
                   help="checkpoints whose MoE layer kinds to bench: Hugging Face directories, "
                   ".gguf files or hub ids in the local Hugging Face cache (repeatable)")
    p.add_argument("--dtype", action="append", metavar="all|FMT[,FMT...]",
                   help=f"expert formats to bench at the {CANONICAL} shape "
                   f"({PRESETS[CANONICAL].hidden}x{PRESETS[CANONICAL].moe_intermediate} "
                   f"top{PRESETS[CANONICAL].top_k}); all: {', '.join(cx.EXPERT_FORMATS)} "
                   "(with no --model, --dtype or --preset: all)")
    p.add_argument("--preset", action="append", metavar="NAME[,NAME...]",
                   help=f"synthetic presets whose layer kinds to bench, each with its "
                   f"family's expert activation ({presets})")
    p.add_argument("--threads", "--moe-cpu-threads", dest="threads", type=int, default=0,
                   metavar="N", help=THREADS_HELP)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the expert cache slots live (auto: cuda if a GPU is visible); on "
                   "cpu the gather is a memcpy between host buffers")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="wall time of each measurement (CPU, gather, overlapped) per kind")
    p.add_argument("--experts", type=int, default=0, metavar="N",
                   help="experts per synthetic bank (0: the layer's own count, or more so "
                   f"that the bank is at least {bw.WORKING_SET_L3}x the L3)")
    p.add_argument("--decode-check", metavar="MEM", type=_size,
                   help="after the rows, decode each --model itself three times, offloaded, "
                   "hybrid and cpu, with a MEM expert cache (what you serve with as "
                   "--moe-cache-mem, e.g. 4GB), where its rows recommend the CPU, and record "
                   "the figures in its rows: --moe-strategy auto at that cache then runs the "
                   "fastest. The GB/s cannot see a GPU step long enough to hide the link, or "
                   "a decode step's overhead per layer (each run loads the model: about a "
                   "minute on a 30 GB file)")
    p.add_argument("--decode-tokens", type=int, default=128, metavar="N",
                   help="timed tokens of each --decode-check run, at temperature 1, after "
                   f"{decode_run.WARMUP} untimed")
    p.add_argument("--out", type=Path, default=profile_path(), metavar="PATH",
                   help="profile file to merge the rows into ($FREETOKEN_BENCHBW_PATH, else "
                   "~/.cache/freetoken/benchbw.json)")


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _split(values: Iterable[str] | None) -> list[str]:
    return [v.strip() for item in values or () for v in item.split(",") if v.strip()]


def collect_targets(models: Sequence[str] = (), dtypes: Sequence[str] = (),
                    presets: Sequence[str] = ()) -> list[Target]:
    """The layer kinds to bench, each once, with every source that has it and the first
    source's activation; names are checked before any checkpoint is opened. Nothing asked for
    means ``--dtype all``."""
    if not (models or dtypes or presets):
        log.info("no --model, --dtype or --preset: benching --dtype all at the %s shape; pass "
                 "--model CKPT to bench a checkpoint's own layer kinds", CANONICAL)
        dtypes = ["all"]
    for d in dtypes:
        if d != "all" and d not in FORMATS:
            raise ConfigError(f"unknown --dtype {d!r} (choose from all, {', '.join(FORMATS)})")
    for name in presets:
        if name not in PRESETS:
            raise ConfigError(f"unknown --preset {name!r} (choose from {', '.join(PRESETS)})")
    found: dict[LayerKind, Target] = {}

    def add(kind: LayerKind, experts: int, activation: str, bias: bool, source: str) -> None:
        t = found.setdefault(kind, Target(kind, experts, activation, bias=bias))
        if (t.activation, t.bias) != (activation, bias):
            log.warning("layer kind %s has %s experts in %s but %s in %s; its row is benched "
                        "with the first (the row key does not hold the activation)",
                        bw.kind_name(kind), _experts_words(t.activation, t.bias),
                        ", ".join(t.sources), _experts_words(activation, bias), source)
        t.experts = max(t.experts, experts)
        if source not in t.sources:
            t.sources.append(source)

    for model in models:
        for kind, experts, activation, bias in checkpoint_kinds(model):
            add(kind, experts, activation, bias, model)
    canon = PRESETS[CANONICAL]
    for d in dict.fromkeys(cx.EXPERT_FORMATS if "all" in dtypes else dtypes):
        fmt, options = cpu_format(d, d, d)
        kind = LayerKind(fmt, canon.hidden, canon.moe_intermediate, canon.top_k, options)
        add(kind, canon.experts, "silu", False, f"dtype:{d}")
    for name in dict.fromkeys(presets):
        spec = resolve_spec(name, gguf=True)
        p, cfg = spec.preset, ModelConfig.from_hf(hf_config(spec))
        for f in dict.fromkeys(spec.expert_formats):
            fmt, options = cpu_format(f, f, f)
            kind = LayerKind(fmt, p.hidden, p.moe_intermediate, p.top_k, options)
            add(kind, p.experts, cfg.hidden_act, cfg.expert_bias, f"preset:{name}")
    return list(found.values())


def _experts_words(activation: str, bias: bool) -> str:
    return f"{activation}{' biased' if bias else ''}"


def checkpoint_kinds(model: str) -> list[tuple[LayerKind, int, str, bool]]:
    """(kind, experts per layer, activation, biased experts) of each MoE layer kind of a
    checkpoint."""
    from freetoken.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    kinds = layer_kinds(ckpt)
    if not kinds:
        raise CheckpointError(f"{model}: no MoE layers, so there is nothing to bench; pass an "
                              "MoE checkpoint, or --dtype / --preset for canonical shapes")
    for kind, layers in kinds.items():
        log.info("%s: layers %s are %s", model, ",".join(map(str, layers)), bw.kind_name(kind))
    mc = ckpt.config
    return [(k, mc.num_experts, mc.hidden_act, mc.expert_bias) for k in kinds]


def resolve_device(name: str) -> torch.device:
    """``auto`` is cuda when a GPU is visible, else cpu; cuda without a GPU is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def bench_kinds(targets: Sequence[Target], threads: int = 0, device: str = "auto",
                seconds: float = 1.0, experts: int | None = None,
                progress: bool = False) -> dict[str, Row]:
    """Bench each target; rows by key. ``threads`` follows --moe-cpu-threads (0: one worker per
    usable core but the first). A kind the CPU kernels cannot run is skipped with a warning."""
    from tqdm import tqdm

    if seconds <= 0:
        raise ConfigError(f"--seconds must be positive, got {seconds}")
    if threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {threads}")
    reason = cx.available()
    if reason is not None:
        raise ConfigError(f"ft bench bw needs the CPU MoE library, but {reason}")
    dev = resolve_device(device)
    # the pool `ft serve` would run with the flag: one that would leave the main thread no
    # core of its own is cut to the cores there are, and its row is keyed by what is left
    cores = core_plan(usable_cores(), True, threads or None)
    if cores.shrink_note():
        log.warning("%s", cores.shrink_note())
    threads = len(cores.workers)
    if experts is not None and experts < 1:
        raise ConfigError(f"--experts must be positive, got {experts}")
    for t in targets:
        if experts is not None and experts < t.kind.top_k:
            raise ConfigError(f"--experts {experts} is fewer than top-k {t.kind.top_k} of "
                              f"{bw.kind_name(t.kind)}; pass --experts {t.kind.top_k} or more")
    common = _host_meta(dev)
    rows: dict[str, Row] = {}
    with tqdm(total=len(targets) * len(PHASES), desc="ft bench bw", unit="phase",
              disable=not progress) as bar:
        for t in targets:
            done = _bench_one(t, threads, dev, seconds, experts, common, bar)
            if done is not None:
                rows[done[0]] = done[1]
    return rows


def _bench_one(t: Target, threads: int, dev: torch.device, seconds: float,
               experts: int | None, common: dict[str, object], bar: Any,
               ) -> tuple[str, Row] | None:
    """One kind's key and row, None when it is skipped. Its bank and executor are freed on
    return, before the next kind's are made."""
    name = bw.kind_name(t.kind)

    def skip(why: object, phases_left: int) -> None:
        log.warning("skipping layer kind %s (from %s): %s", name, ", ".join(t.sources), why)
        bar.update(phases_left)

    def running(phase: str) -> None:
        bar.set_postfix_str(f"{name} {phase}")

    missing = bw.cpu_kernel_missing(t.kind, t.activation, t.bias)
    if missing is not None:
        skip(missing, len(PHASES))
        return None
    running("banks")
    bank = bw.synthetic_bank(t.kind, experts, t.experts, pinned=dev.type == "cuda")
    bar.update()
    ex = cx.CpuMoeExecutor(threads=threads)  # what `ft serve` does with the flag
    try:
        try:
            bench = bw.LayerBench(t.kind, bank, ex, dev, t.activation, bias=t.bias)
        except ValueError as e:  # the kernels refuse this shape or format mix
            skip(e, len(PHASES) - 1)
            return None
        running("cpu")
        cpu = bench.cpu(seconds)
        bar.update()
        running("gather")
        pcie = bench.gather(seconds)
        bar.update()
        running("overlapped")
        cpu_ov, pcie_ov = bench.overlapped(seconds)
        bar.update()
    finally:
        ex.close()
    meta = {**common, "isa": ex.isa, "cores": list(ex.cores), "activation": t.activation,
            "kernels": [f"{isa}/{act}" for isa, act in bench.kernels],
            "sources": list(t.sources), "experts": bank.num_experts,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return t.kind.key(ex.threads), Row(cpu, pcie, cpu_ov, pcie_ov, meta)


def _host_meta(device: torch.device) -> dict[str, object]:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": device.type, "gpu": gpu, "cpu_model": cpu_model(),
            "threshold": HYBRID_MARGIN, "commit": _commit()}


def _commit() -> str | None:
    """The package's git commit, ``+dirty`` when its tree has changes; None outside git.
    FREETOKEN_GIT_SHA names it for a tree copied without its history."""
    if env.git_sha():
        return env.git_sha()
    root = Path(__file__).resolve().parents[2]

    def git(*cmd: str) -> str | None:
        try:
            r = subprocess.run(["git", "--no-optional-locks", "-C", str(root), *cmd],
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if not sha:
        return None
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def decode_check(rows: dict[str, Row], models: Sequence[str], device: str, threads: int,
                 cache_bytes: int, tokens: int, profile: Path,
                 progress: bool = False) -> dict[str, Row]:
    """``rows`` with each model's own rows given its :class:`DecodeCheck`: offload and the
    strategies that use the CPU (hybrid, cpu), decoded on the model where its rows recommend
    one of those (none where they all recommend offload already), by engines that read
    ``profile`` (``rows`` saved there)."""
    from tqdm import tqdm

    _check_decode_args(cache_bytes, tokens)
    dev = resolve_device(device).type
    out = dict(rows)
    for model in models:
        keys = [k for k, r in rows.items() if model in r.meta.get("sources", ())]
        wanted = CPU_STRATEGIES if {rows[k].recommended for k in keys} - {"offload"} else ()
        if not wanted:
            log.info("decode check of %s: its rows recommend offload, so there is nothing to "
                     "weigh against it", model)
            continue
        figures: dict[str, float] = {}
        for strategy in tqdm(["offload", *wanted], desc=f"decode check {Path(model).name}",
                             unit="run", disable=not progress):
            figures[strategy] = decode_run.decode_tokens_per_s(
                model, strategy, dev, threads, cache_bytes, tokens, profile)
        check = DecodeCheck(model, cache_bytes, tokens, figures)
        log.info("decode check of %s: %s", model, check.words())
        for k in keys:
            out[k] = replace(rows[k], decode=check)
    return out


def _check_decode_args(cache_bytes: int, tokens: int) -> None:
    if cache_bytes <= 0:
        raise ConfigError(f"--decode-check must be a positive size, got {cache_bytes}")
    if tokens < 1:
        raise ConfigError(f"--decode-tokens must be at least 1, got {tokens}")


def bench_bw_main(args: argparse.Namespace) -> int:
    """``ft bench bw``: bench, merge the rows into the profile, print the table and the path."""
    models = _split(args.model)
    if args.decode_check is not None and not models:
        raise ConfigError("--decode-check decodes the checkpoints given with --model; pass one")
    if args.decode_check is not None:
        _check_decode_args(args.decode_check, args.decode_tokens)
    targets = collect_targets(models, _split(args.dtype), _split(args.preset))
    if args.experts < 0:
        raise ConfigError(f"--experts must be >= 0, got {args.experts}")
    progress = sys.stderr.isatty()
    rows = bench_kinds(targets, args.threads, args.device, args.seconds, args.experts or None,
                       progress=progress)
    if not rows:
        raise ConfigError("no layer kind could be benched (see the warnings above)")
    path = save_rows(rows, args.out)
    if args.decode_check is not None:  # its hybrid runs split by the rows just saved
        rows = decode_check(rows, models, args.device, args.threads, args.decode_check,
                            args.decode_tokens, path, progress)
        save_rows(rows, path)
    print(format_table(rows))
    print(f"wrote {len(rows)} row{'s' if len(rows) != 1 else ''} to {path}")
    return 0
