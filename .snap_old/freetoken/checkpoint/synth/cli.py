"""``ft synth``: flags and entry point."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from freetoken.checkpoint.synth.presets import (
    PRESETS,
    resolve_spec,
)
from freetoken.checkpoint.synth.weights import WINDOW
from freetoken.checkpoint.synth.write import write_synth

log = logging.getLogger(__name__)


def add_synth_args(p: argparse.ArgumentParser) -> None:
    geometry = "; ".join(
        f"{n}: {q.hidden}x{q.moe_intermediate}, {q.experts} experts top-{q.top_k}, "
        f"{q.layers} layers, {q.expert_format}" for n, q in PRESETS.items())
    p.add_argument("--preset", required=True, choices=list(PRESETS), help=geometry)
    p.add_argument("--out", required=True, type=Path,
                   help="PATH.gguf writes one GGUF file; any other path an HF directory "
                   "(bf16 safetensors, sharded past 4 GiB, tokenizer files)")
    p.add_argument("--expert-format", metavar="SPEC", help=(
        "expert formats per layer (GGUF only; HF is bf16): FORMAT for every layer, or a comma "
        "list of FORMAT (one layer), FORMAT*N (N layers) and one FORMAT* (the remaining layers),"
        " e.g. q8_0, q8_0*29,bf16 or q8_0*,bf16 (default: the preset's; a -FORMAT preset is "
        "its base preset with --expert-format FORMAT, named so that `ft bench bw --preset` "
        "benches it too). Norms and routers are f32; other matrices q8_0 when most expert "
        "layers are quantized, else bf16. nvfp4 is written as GGUF NVFP4 (blocks of 64, "
        "no global scale)"))
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--experts", type=int, help="override the preset's experts per layer")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--router-skew", type=float, default=0.0, metavar="S",
                   help="expert popularity: rank r is picked ~r^-S as often as rank 1 "
                   "(0 = uniform, 1 = Zipf)")
    p.add_argument("--router-locality", type=float, default=0.0, metavar="L",
                   help=f"0..1: share of the router logit from a ~{WINDOW}-token moving "
                   "average, so consecutive tokens pick similar experts (0 = none)")
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where weights are drawn and quantised (cuda is much faster at full "
                   "size; the same seed gives different weights on cpu and cuda)")


def synth_main(args: argparse.Namespace) -> int:
    gguf = Path(args.out).suffix == ".gguf"
    spec = resolve_spec(args.preset, gguf, args.expert_format, args.layers, args.experts,
                        args.vocab, args.router_skew, args.router_locality, args.seed)
    p = spec.preset
    log.info("synth %s: %d layers, %d experts top-%d, vocab %d, experts %s, matrices %s, "
             "skew %g, locality %g, seed %d", p.name, p.layers, p.experts, p.top_k, p.vocab,
             ",".join(spec.expert_formats), spec.matrix_format if gguf else "bf16",
             spec.router_skew, spec.router_locality, spec.seed)
    out = write_synth(spec, args.out, args.overwrite, progress=sys.stderr.isatty(),
                      device=args.device)
    size = out.stat().st_size if out.is_file() else sum(
        f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"{out} ({size / 1e9:.2f} GB)" if size >= 1e8 else f"{out} ({size / 1e6:.2f} MB)")
    return 0
