"""The fused gather-GEMV's launch choices (:mod:`.gather_gemv`): per weight format, blocks a
loop step, output rows and warps a program, and which reader a Q8_0x8 kernel uses. The table
(:data:`KERNELS`) holds what sweeps on a GPU chose; FREETOKEN_GEMV_LAUNCH overrides entries
without a rebuild (``benchmarks/gather_gemv.py --sweep`` prints the value to export).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from freetoken import env
from freetoken.errors import ConfigError
from freetoken.quant import get_format

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedKernel:
    """A format's gather-GEMV (:mod:`.triton_gemv` compiled for it): blocks per loop
    step, output rows per program (enough programs to fill the GPU at one token) and warps per
    program (tuned on the H200 by ``benchmarks/gather_gemv.py --sweep``); its block (weights
    and bytes) is the quant format's. ``bits`` (q8_0, mxfp4, nvfp4): the weights and bf16
    activations become float32 by integer and add instructions instead of conversion
    instructions, which a GPU runs at a quarter of its rate (the same values, the same
    sums). ``sums`` (q8_0x8, the expert and the dense kernels): a block's products summed
    before its scale (``triton_q8_0x8.q8_0x8_sums``: fewer instructions a weight, other
    roundings). ``int8_x`` (q8_0x8, the expert and the dense kernels): x quantised to int8
    per 32-value block in the kernel and each block's products summed as integers
    (``triton_q8_0x8.q8_0x8_int8``: fewer instructions still; x's rounding, as llama.cpp's
    GPU kernels round it)."""

    fmt: str
    step: int = 1
    rows: int = 16
    warps: int = 4
    bits: bool = False
    sums: bool = False
    int8_x: bool = False

    def __post_init__(self) -> None:
        for name in ("sums", "int8_x"):  # their readers read Q8_0x8's places alone
            if getattr(self, name) and self.fmt != "q8_0x8":
                raise ValueError(f"{self.fmt}: {name} is a launch choice of q8_0x8 alone")
        if self.sums and self.int8_x:
            raise ValueError("q8_0x8: sums and int8_x are two readers; choose one")

    @property
    def block(self) -> int:
        return get_format(self.fmt).block_size

    @property
    def block_bytes(self) -> int:
        return get_format(self.fmt).block_bytes


# One qwen3-30b-a3b layer (8 pairs of 2048 x 768 experts) in a CUDA graph: H200, 4006e51:
# q8_0 77 -> 45 us, q4_k/q4_k/q6_k 59 -> 48 us against the first choice (rows 16, warps 4).
# H100, eca228c (q8_0's products summed after the loop): q8_0 37.0 us at rows 2, step 8,
# warps 2 (the kernel before it: 46.8). mxfp4, gpt-oss-20b's 4 pairs of 2880 x 2880: 91.9 us
# at rows 2, step 32, warps 1 (dequantise + matmul 1,912); H100, 43d3cf3's sweep: 85.6 with
# bits at rows 1 (91.5 at the old choice; q8_0 with bits 42.7 against 38.0, so off). q5_0
# keeps the first choice (not swept); q5_k takes q4_k's choices, not tuned on a GPU for q5_k.
# nvfp4, Gemma-4 26B-A4B's 8 pairs of 2816 x 704 (GGUF blocks, 16 weights each: 176 and 44
# a row), H100, one sweep: 49.1 us at rows 2, step 16, warps 1 with bits (48.2 at rows 4; 61.3
# at mxfp4's choice, step 32; dequantise + matmul 1,223; mxfp4's kernel at its shape 47.8).
# q8_0x8 (resident's regrouped Q8_0), H100, f51bd7f's sweep of int8_x: 19.8 us at rows 4,
# step 8, warps 1 (the float reader at rows 2, step 8, warps 2: 29.6; q8_0's: 31.6).
KERNELS: dict[str, FusedKernel] = {
    "q8_0": FusedKernel("q8_0", step=8, rows=2, warps=2),
    "q8_0x8": FusedKernel("q8_0x8", step=8, rows=4, warps=1, int8_x=True),
    "q5_0": FusedKernel("q5_0", step=4),
    "mxfp4": FusedKernel("mxfp4", step=32, rows=1, warps=1, bits=True),
    "nvfp4": FusedKernel("nvfp4", step=16, rows=2, warps=1, bits=True),
    "q4_k": FusedKernel("q4_k", rows=8, warps=2),
    "q5_k": FusedKernel("q5_k", rows=8, warps=2),
    "q6_k": FusedKernel("q6_k", rows=8, warps=2),
}


INTERPRETER_ROWS = 16  # output rows a program takes at least in Triton's interpreter (tests)


def launch(fmt: str) -> FusedKernel:
    """``fmt``'s launch choices: FREETOKEN_GEMV_LAUNCH's entry for it, else :data:`KERNELS`."""
    return _launch_overrides().get(fmt) or KERNELS[fmt]


def launch_on(fmt: str, device: torch.device) -> FusedKernel:
    """:func:`launch`'s choices, with at least :data:`INTERPRETER_ROWS` rows a program on the
    CPU (Triton's interpreter: fewer, larger programs)."""
    spec = launch(fmt)
    if device.type == "cpu":
        spec = dataclasses.replace(spec, rows=max(spec.rows, INTERPRETER_ROWS))
    return spec


@functools.cache
def _launch_overrides() -> dict[str, FusedKernel]:
    found = {}
    for entry in env.gemv_launch().split():
        fmt, _, values = entry.partition("=")
        try:
            rows, step, warps, *more = (int(v) for v in values.split(","))
        except ValueError:
            rows, step, warps, more = 0, 0, 0, []
        flags_ok = len(more) <= 3 and set(more) <= {0, 1} and (
            not any(more[1:]) or fmt == "q8_0x8") and sum(more[1:]) < 2
        if min(rows, step, warps) < 1 or fmt not in KERNELS or not flags_ok:
            raise ConfigError(f"FREETOKEN_GEMV_LAUNCH entry {entry!r} is not "
                              f"fmt=rows,step,warps[,bits[,sums[,int8_x]]] with a format of "
                              f"{', '.join(KERNELS)}, positive integers, bits 0 or 1, "
                              "sums and int8_x 0 or 1 (1 for q8_0x8 alone, not both), say "
                              "q8_0=4,16,2")
        base = KERNELS[fmt]
        # a reader named (sums given) leaves int8_x off unless given; else the table's
        readers = (bool(more[1]), len(more) > 2 and bool(more[2])) if len(more) > 1 else (
            base.sums, base.int8_x)
        found[fmt] = dataclasses.replace(base, rows=rows, step=step, warps=warps,
                                         bits=bool(more[0]) if more else base.bits,
                                         sums=readers[0], int8_x=readers[1])
    if found:
        log.info("fused gather-GEMV launch choices from FREETOKEN_GEMV_LAUNCH: %s",
                 ", ".join(f"{k.fmt} rows {k.rows} step {k.step} warps {k.warps} bits "
                           f"{int(k.bits)} sums {int(k.sums)} int8_x {int(k.int8_x)}"
                           for k in found.values()))
    return found


def fused(formats: tuple[str, ...]) -> bool:
    """Whether every projection format has a fused kernel (asked when a layer is built, so a
    FREETOKEN_GEMV_LAUNCH that cannot be read fails there, at startup, not at a decode)."""
    _launch_overrides()
    return all(f in KERNELS for f in formats)
