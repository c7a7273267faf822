"""What the fused expert kernels ask of the memory system, read from their PTX (no GPU needed):
each kernel compiled for sm_90 by Triton, with the 16-byte divisibility the launches have
(pointers, strides), and its global loads counted by width.

Q8_0's 34-byte blocks leave each block's 32 values 2-byte aligned, so its values come one or
two bytes a load; Q8_0x8 (``quant/q8_0x8.py``) puts eight blocks' scales first and their values
16-byte aligned after them. The count is static (instructions in the program, not executed
ones): it shows the load width the compiler could use, not a speed.

    python benchmarks/gemv_ptx.py
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402

DIVISIBLE = ("w_ptr", "index_ptr", "x_ptr", "out_ptr", "slot_stride", "row_stride", "x_stride",
             "out_stride")


def loads(kernel: str, signature: dict[str, str], constexprs: dict[str, Any],
          warps: int) -> dict[str, int]:
    """Global load instructions of ``kernel``'s PTX by kind (``ld.global.v4.b32``: 16 bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from freetoken.kernels import triton_gemv

    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in names}
    src = ASTSource(fn=getattr(triton_gemv, kernel), signature=signature, constexprs=constexprs,
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps}).asm["ptx"]
    return dict(Counter(re.findall(r"ld\.global[\w.]*", ptx)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    from freetoken.kernels.gather_gemv import KERNELS

    gather = {"w_ptr": "*u8", "index_ptr": "*i64", "x_ptr": "*bf16", "out_ptr": "*bf16",
              "R": "i32", "per": "i32", "slot_stride": "i64", "row_stride": "i32",
              "x_stride": "i32", "out_stride": "i32", "FMT": "constexpr", "NB": "constexpr",
              "BLOCK_R": "constexpr", "STEP": "constexpr", "ACT": "constexpr",
              "BITS": "constexpr"}
    dense = {"w_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*bf16", "R": "i32", "T": "i32",
             "row_stride": "i32", "x_stride": "i32", "out_stride": "i32", "NB": "constexpr",
             "BLOCK_R": "constexpr", "STEP": "constexpr", "TOK": "constexpr",
             "BITS": "constexpr"}
    rows = []
    for fmt, act in (("q8_0", 1), ("q8_0", 0), ("q8_0x8", 1), ("q8_0x8", 0)):
        k = KERNELS[fmt]
        nb = 2048 // k.block  # a 2048-wide row: gate/up's
        rows.append({"kernel": "gather_gemv", "fmt": fmt, "act": act, "rows": k.rows,
                     "step": k.step, "warps": k.warps, "bits": k.bits,
                     "loads": loads("gather_gemv", gather, {
                         "FMT": fmt, "NB": nb, "BLOCK_R": max(1, k.rows // 2) if act else k.rows,
                         "STEP": k.step, "ACT": act, "BITS": k.bits}, k.warps)})
    k = KERNELS["q8_0x8"]
    for tok in (1, 8):
        rows.append({"kernel": "dense_gemv", "fmt": "q8_0x8", "tokens": tok, "rows": k.rows,
                     "step": k.step, "warps": k.warps, "bits": k.bits,
                     "loads": loads("dense_gemv", dense, {
                         "NB": 8, "BLOCK_R": k.rows, "STEP": k.step, "TOK": tok,
                         "BITS": k.bits}, k.warps)})
    for r in rows:
        what = f"{r['kernel']} {r['fmt']}" + (f" act {r['act']}" if "act" in r else
                                              f" {r['tokens']} tokens")
        print(f"{what:>28}: " + ", ".join(f"{n} x{c}" for n, c in sorted(r["loads"].items())))
    import triton

    result = {"bench": "gemv_ptx", "label": args.label, **git_state(), **host(),
              "triton": triton.__version__, "target": "sm_90", "rows": rows}
    save_result(args.out, f"gemv_ptx{'-' + args.label if args.label else ''}", result)


if __name__ == "__main__":
    main()
