"""What the fused expert kernels ask of the memory system, read from their PTX (no GPU needed):
each kernel compiled for sm_90 by Triton, with the 16-byte divisibility the launches have
(pointers, strides), and its global loads counted by width.

Q8_0's 34-byte blocks leave each block's 32 values 2-byte aligned, so its values come one or
two bytes a load; Q8_0x8 (``quant/q8_0x8.py``) puts eight blocks' scales first and their values
16-byte aligned after them. The count is static (instructions in the program, not executed
ones): it shows the load width the compiler could use, not a speed.

``--sass`` also counts the gather kernel's machine instructions a weight (its SASS, loops
counted as many times as their bounds say) at several launch choices: Nsight Compute found
the q8_0 kernels issue-bound (``benchmarks/device/ncu_gemv.sh``), so fewer instructions a
weight is what a faster kernel needs. Also static: a guide to what to time, not a time.

    python benchmarks/gemv_ptx.py --sass
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


def compiled(kernel: str, signature: dict[str, str], constexprs: dict[str, Any],
             warps: int) -> Any:
    """``kernel`` compiled for sm_90 (PDL, SUMS and INT8_X off unless ``constexprs`` says;
    ASM on: the GPU's instructions, not the interpreter's twins)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from freetoken.kernels import triton_gemv

    fn = getattr(triton_gemv, kernel)
    extra = {n: n == "ASM" for n in ("PDL", "SUMS", "INT8_X", "ASM")
             if n in fn.arg_names and n not in constexprs}
    signature = {**signature, **{n: "constexpr" for n in extra}}
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE if n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **extra}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def loads(kernel: str, signature: dict[str, str], constexprs: dict[str, Any],
          warps: int) -> dict[str, int]:
    """Global load instructions of ``kernel``'s PTX by kind (``ld.global.v4.b32``: 16 bytes)."""
    ptx = compiled(kernel, signature, constexprs, warps).asm["ptx"]
    return dict(Counter(re.findall(r"ld\.global[\w.]*", ptx)))


def cubin_tool(kernel: Any, tool: str, *flags: str) -> str:
    """What ``tool`` (one of the CUDA binary tools Triton ships) prints of ``kernel``'s cubin."""
    import subprocess
    import tempfile

    import triton

    path = Path(triton.__file__).parent / "backends/nvidia/bin" / tool
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(path), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def instructions(kernel: Any, iterations: float) -> int:
    """Machine instructions a thread of ``kernel`` runs (its SASS, from nvdisasm): the
    straight code once and each loop (a backward branch) ``iterations`` times. Static: every
    branch taken as the loop's bounds say, none of the rest skipped."""
    text = cubin_tool(kernel, "nvdisasm", "-c")
    code: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        if m := re.match(r"\s*\.(L_x_\d+):", line):
            labels[m.group(1)] = len(code)
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            code.append(m.group(1))
    total = len(code)
    for i, op in enumerate(code):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", op)
        if m and m.group(1) in labels and labels[m.group(1)] < i - 2:  # a loop, not a spin
            total += round((i - labels[m.group(1)] + 1) * (iterations - 1))
    return total


def per_weight(fmt: str, act: int, rows: int, step: int, warps: int, sums: bool,
               signature: dict[str, str], width: int = 2048,
               int8_x: bool = False) -> dict[str, Any]:
    """Instructions a weight, a thread, of the gather kernel at one launch choice (rows: the
    launch's output rows; with ``act`` a program takes half, each with gate's and up's)."""
    block = 256 if fmt == "q8_0x8" else 32
    nb = width // block
    r = max(1, rows // 2) if act else rows
    kernel = compiled("gather_gemv", signature, {
        "FMT": fmt, "NB": nb, "BLOCK_R": r, "STEP": step, "ACT": act, "BITS": False,
        "SUMS": sums, "INT8_X": int8_x}, warps)
    blocks = width // 32
    n = instructions(kernel, blocks / step)
    weights = (2 if act else 1) * r * width / (32 * warps)  # a thread's share of a program's
    return {"fmt": fmt, "act": act, "rows": rows, "step": step, "warps": warps, "sums": sums,
            "int8_x": int8_x, "registers": registers(kernel), "instructions": n,
            "per_weight": n / weights}


def registers(kernel: Any) -> int:
    """Registers a thread of ``kernel`` holds (cuobjdump's resource usage of its cubin)."""
    found = re.search(r"REG:(\d+)", cubin_tool(kernel, "cuobjdump", "-res-usage"))
    return int(found.group(1)) if found else -1


# launch choices (output rows, blocks a step, warps) whose instructions --sass counts
SASS_CHOICES = ((2, 8, 2), (2, 8, 1), (4, 8, 1), (8, 8, 1), (4, 8, 2), (8, 8, 2), (16, 8, 4),
                (8, 16, 2), (16, 16, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="")
    p.add_argument("--sass", action="store_true",
                   help="also count the gather kernel's machine instructions a weight at "
                        "several launch choices (q8_0, q8_0x8, q8_0x8 with block sums, "
                        "q8_0x8 with int8 x)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    from freetoken.kernels.gemv_launch import KERNELS

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
    counts = []
    if args.sass:
        for fmt, sums, ix in (("q8_0", False, False), ("q8_0x8", False, False),
                              ("q8_0x8", True, False), ("q8_0x8", False, True)):
            for act in (1, 0):
                for r, step, warps in SASS_CHOICES:
                    counts.append(per_weight(fmt, act, r, step, warps, sums, gather,
                                             int8_x=ix))
                    c = counts[-1]
                    print(f"  {fmt:6s} sums {int(sums)} int8_x {int(ix)} act {act} rows {r:2d} "
                          f"step {step:2d} "
                          f"warps {warps}: {c['registers']:3d} registers, "
                          f"{c['per_weight']:5.2f} instructions a weight", flush=True)
    import triton

    result = {"bench": "gemv_ptx", "label": args.label, **git_state(), **host(),
              "triton": triton.__version__, "target": "sm_90", "rows": rows,
              "instructions_a_weight": counts}
    save_result(args.out, f"gemv_ptx{'-' + args.label if args.label else ''}", result)


if __name__ == "__main__":
    main()
