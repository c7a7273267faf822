"""The C++ CPU MoE library (csrc/): loading it, its C signatures, and what it can do here.

One shared library with a C ABI, loaded with ctypes (no Python or torch headers), built by the
package install next to this package's files. It is checked against :mod:`.abi` when it loads.
Everything that asks the library a question (best ISA, which kernel a format gets, byte
counts) lives here; the executor drives it.
"""

from __future__ import annotations

import ctypes
import importlib.resources
import logging
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from freetoken import env
from freetoken.cpu import abi
from freetoken.cpu.abi import ACT_KINDS, FORMATS, ISAS, GluDesc, ProjDesc
from freetoken.quant import get_format

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LIBRARY = "libfreetoken_cpu.so"
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}  # csrc/expert_op.h Activation
# the experts' gated activations: GPT-OSS's clamped SwiGLU besides act(g) * u
EXPERT_ACTIVATIONS = {**ACTIVATIONS, "swiglu_oai": 3}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MAX_IN_FLIGHT = 16  # job slots of the C++ pool


class NativeUnavailable(RuntimeError):
    """The C++ library is missing or failed to load; the message says why and what to do."""


def isa_cap_from_env() -> str | None:
    """The ISA cap from FREETOKEN_CPU_ISA (see freetoken.env.cpu_isa), validated."""
    value = env.cpu_isa()
    if value and value not in ISAS:
        raise ValueError(f"FREETOKEN_CPU_ISA={value!r} (choose from {', '.join(ISAS)})")
    return value or None


def _library_path() -> Path:
    return Path(str(importlib.resources.files("freetoken") / LIBRARY))


@cache
def native() -> ctypes.CDLL:
    """The loaded C++ library; :class:`NativeUnavailable` with the reason if it cannot be."""
    path = _library_path()
    if not path.exists():
        raise NativeUnavailable(
            f"the CPU MoE library ({LIBRARY}) was not built: it is not in {path.parent}; "
            "reinstall with `pip install -e .` (needs cmake and a C++17 compiler) and read the "
            "build log"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise NativeUnavailable(f"the CPU MoE library {path} does not load: {e}") from e
    _declare(lib, path, abi.SIGNATURES)
    wrong = abi.mismatches(lib)
    if wrong:
        raise NativeUnavailable(
            f"the CPU MoE library {path} was built from other sources than this package "
            f"({'; '.join(wrong)}); rebuild it with `pip install -e .`")
    c = ctypes
    sigs: dict[str, tuple[object, list[object]]] = {
        "ft_best_isa": (c.c_int, []),
        "ft_kernel_isa": (c.c_int, [c.c_int, c.c_int, c.c_int]),
        "ft_batch_isa": (c.c_int, [c.c_int, c.c_int]),
        "ft_batch_linear": (c.c_int, [c.c_int, c.c_int, c.c_void_p, c.c_int64, c.c_int64,
                                      c.c_int64, c.c_void_p, c.c_int, c.c_void_p]),
        "ft_batch_vectors": (c.c_int, []),
        "ft_linear_batch_isa": (c.c_int, [c.c_void_p, c.c_int]),
        "ft_executor_new": (c.c_void_p, [c.c_void_p, c.c_int, c.c_int, c.c_int]),
        "ft_executor_free": (None, [c.c_void_p]),
        "ft_executor_threads": (c.c_int, [c.c_void_p]),
        "ft_executor_isa": (c.c_int, [c.c_void_p]),
        "ft_worker_states": (None, [c.c_void_p, c.POINTER(c.c_int64)]),
        "ft_free_jobs": (c.c_int, [c.c_void_p]),
        "ft_add_layer": (
            c.c_int,
            [
                c.c_void_p,
                c.c_int,
                c.c_int,
                c.c_int,
                c.c_int,
                c.c_int,
                c.POINTER(GluDesc),
                c.POINTER(ProjDesc),
                c.POINTER(ProjDesc),
                c.POINTER(ProjDesc),
                c.c_int,
                c.c_char_p,
                c.c_int,
            ],
        ),
        "ft_layer_kernel": (
            c.c_int,
            [c.c_void_p, c.c_int, c.c_int, c.POINTER(c.c_int), c.POINTER(c.c_int)],
        ),
        "ft_submit": (
            c.c_int64,
            [c.c_void_p, c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int,
             c.c_void_p],
        ),
        "ft_run": (
            c.c_int64,
            [c.c_void_p, c.c_int, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_int, c.c_int,
             c.POINTER(c.c_int64)],
        ),
        "ft_run_linear": (
            c.c_int64,
            [c.c_void_p, c.c_int, c.c_void_p, c.c_void_p, c.c_int, c.POINTER(c.c_int64)],
        ),
        "ft_decode_layer": (c.c_int, [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p]),
        "ft_wait": (
            c.c_int64, [c.c_void_p, c.c_int64, c.POINTER(c.c_int64), c.POINTER(c.c_int64)],
        ),
        "ft_set_timing": (None, [c.c_void_p, c.c_int]),
        "ft_set_down_split": (c.c_int, [c.c_void_p, c.c_int]),
        "ft_set_join": (None, [c.c_void_p, c.c_int]),
        "ft_attention_decode": (
            None,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
             c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_float, c.c_void_p],
        ),
        "ft_rms_norm": (
            None, [c.c_void_p, c.c_void_p, c.c_int64, c.c_int, c.c_float, c.c_int, c.c_void_p],
        ),
        "ft_rotary_neox": (
            c.c_int,
            [c.c_void_p, c.c_void_p, c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int,
             c.c_int, c.c_void_p],
        ),
        "ft_route_topk": (
            None, [c.c_void_p, c.c_int64, c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_void_p],
        ),
        "ft_glu": (
            None, [c.c_void_p, c.c_int64, c.c_void_p, c.c_int64, c.c_int64, c.c_int, c.c_int,
                   c.c_void_p],
        ),
        "ft_set_gate_up_rows": (c.c_int, [c.c_void_p, c.c_int]),
        "ft_set_batch_from": (None, [c.c_void_p, c.c_int]),
        "ft_add_linear": (
            c.c_int, [c.c_void_p, c.c_int, c.POINTER(ProjDesc), c.c_int, c.c_char_p, c.c_int],
        ),
        "ft_linear_kernel": (
            c.c_int, [c.c_void_p, c.c_int, c.POINTER(c.c_int), c.POINTER(c.c_int)],
        ),
        "ft_submit_linear": (
            c.c_int64, [c.c_void_p, c.c_int, c.c_void_p, c.c_void_p, c.c_int],
        ),
        "ft_copy_rows": (c.c_int, [c.POINTER(abi.RowCopyApi), c.POINTER(abi.RowCopy)]),
        "ft_plan_layer_call": (c.c_int, [c.POINTER(abi.LayerCall)]),
        "ft_fetch_count": (c.c_int, [c.POINTER(abi.FetchRule), c.c_int,
                                     c.POINTER(c.c_int)]),
        "ft_ahead_count": (c.c_int, [c.POINTER(abi.AheadRule), c.c_int]),
        "ft_copy_spans": (
            c.c_int, [c.POINTER(abi.RowCopyApi), c.c_void_p, c.c_int, c.c_void_p, c.c_void_p,
                      c.c_void_p, c.c_void_p, c.c_int],
        ),
        "ft_wait_event": (c.c_int, [c.POINTER(abi.RowCopyApi), c.c_void_p, c.c_void_p, c.c_int]),
        "ft_host_node_run": (None, [c.c_void_p]),
        "ft_flag_jobs_serve": (c.c_int, [c.POINTER(abi.FlagJobs)]),
        "ft_flag_jobs_release": (None, [c.POINTER(abi.FlagJobs)]),
        "ft_flag_wait": (c.c_int, [c.c_void_p, c.c_int, c.c_int]),
        "ft_stream_read": (c.c_double, [c.c_void_p, c.c_void_p, c.c_int64, c.c_int]),
        "ft_slots_new": (c.c_void_p, [c.c_int]),
        "ft_slots_free": (None, [c.c_void_p]),
        "ft_slots_add_layer": (c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int]),
        "ft_slots_lookup": (c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p]),
        "ft_slots_admit": (
            c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p],
        ),
        "ft_slots_route": (
            c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p,
                      c.c_void_p],
        ),
        "ft_slots_split": (
            c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p,
                      c.c_void_p, c.c_int, c.c_int, c.c_void_p, c.c_void_p, c.c_void_p],
        ),
        "ft_slots_rank": (
            c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p],
        ),
        "ft_slots_admit_ranked": (
            c.c_int, [c.c_void_p, c.c_int, c.c_void_p, c.c_int, c.c_void_p, c.c_void_p],
        ),
        "ft_slots_state": (None, [c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p]),
        "ft_set_prefetch": (None, [c.c_int, c.c_int]),
        "ft_quantize_q8": (
            c.c_int, [c.c_int, c.c_void_p, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p],
        ),
    }
    _declare(lib, path, sigs)
    return lib


def _declare(lib: ctypes.CDLL, path: Path, sigs: dict[str, tuple[object, list[object]]]) -> None:
    for name, (restype, argtypes) in sigs.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise NativeUnavailable(
                f"the CPU MoE library {path} is older than this package (it has no {name}); "
                "rebuild it with `pip install -e .`") from e
        fn.restype = restype
        fn.argtypes = argtypes


def available() -> str | None:
    """None when the library loads, else why it does not."""
    try:
        native()
    except NativeUnavailable as e:
        return str(e)
    return None


@cache
def optional(name: str) -> ctypes._CFuncPtr | None:
    """The library's function ``name``, or None where the library is not built; the callers
    (the CPU decode's norm, rotary and attention) then run their torch slow twins."""
    try:
        return getattr(native(), name)
    except NativeUnavailable:
        return None


def best_isa() -> str:
    """The highest ISA tier this CPU supports (ignores FREETOKEN_CPU_ISA)."""
    return ISAS[native().ft_best_isa()]


def run_isa() -> str:
    """The tier the CPU pool runs at: :func:`best_isa` under the FREETOKEN_CPU_ISA cap."""
    best, cap = best_isa(), isa_cap_from_env()
    return best if cap is None else ISAS[min(ISAS.index(best), ISAS.index(cap))]


def kernel_isa(fmt: str, act: str, cap: str) -> str | None:
    """The tier whose kernel (fmt, act) runs with under ``cap``; None if there is none."""
    tier = native().ft_kernel_isa(FORMATS.index(fmt), ACT_KINDS.index(act), ISAS.index(cap))
    return ISAS[tier] if tier >= 0 else None


def batch_isa(fmt: str, cap: str) -> str | None:
    """The tier of ``fmt``'s batched kernel (a prompt's dense matrices) under ``cap``; None if
    there is none. At the top tier it is AMX's where the CPU and OS have it."""
    tier = native().ft_batch_isa(FORMATS.index(fmt), ISAS.index(cap))
    return ISAS[tier] if tier >= 0 else None


def batch_vectors() -> int:
    """Vectors from which a dense matrix's pool job runs its batched kernel."""
    return int(native().ft_batch_vectors())


def batch_linear(data: torch.Tensor, fmt: str, rows: int, cols: int, x: torch.Tensor,
                 cap: str) -> tuple[torch.Tensor, str]:
    """x (M, cols) @ W^T with ``fmt``'s batched kernel at or below ``cap`` on this thread (W:
    the raw blocks ``data``, rows x cols); the result (M, rows) and the tier that ran."""
    import torch

    x = x.detach().to("cpu", torch.float32).contiguous()
    data = data.contiguous()
    out = torch.empty(x.shape[0], rows, dtype=torch.float32)
    tier = native().ft_batch_linear(FORMATS.index(fmt), ISAS.index(cap), data.data_ptr(), rows,
                                    cols, data.numel() * data.element_size() // rows,
                                    x.data_ptr(), x.shape[0], out.data_ptr())
    if tier < 0:
        raise ValueError(f"no batched kernel for {fmt} rows of {cols} at or below {cap}")
    return out, ISAS[tier]


def quantize_q8(x: torch.Tensor, cap: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """The kernels' int8 activations for x (K floats, K % 32 == 0) with the quantiser at or
    below ``cap``: the int8 values (K), the block scales (K / 32), the sums of each group of
    four (K / 4), and the tier that ran."""
    import torch

    x = x.detach().to("cpu", torch.float32).contiguous()
    K = x.numel()
    if K % 32:
        raise ValueError(f"{K} values are not whole 32-blocks")
    q = torch.empty(K, dtype=torch.int8)
    d = torch.empty(K // 32, dtype=torch.float32)
    gs = torch.empty(K // 4, dtype=torch.int32)
    tier = native().ft_quantize_q8(ISAS.index(cap), x.data_ptr(), K, q.data_ptr(), d.data_ptr(),
                                   gs.data_ptr())
    return q, d, gs, ISAS[tier]


def expert_bytes(fmt: str, hidden: int, intermediate: int) -> int:
    """Bytes the kernels read for one expert (gate, up and down, data and scales): the weight
    traffic of one routed expert, which bounds CPU MoE speed by memory bandwidth."""

    def proj(rows: int, cols: int) -> int:
        n = rows * get_format(fmt).row_bytes(cols)
        if fmt == "nvfp4":
            n += rows * (cols // 16)
        elif fmt == "fp8_block":
            n += -(-rows // 128) * -(-cols // 128) * 4
        return n

    return 2 * proj(intermediate, hidden) + proj(hidden, intermediate)


def set_prefetch(nbytes: int, level: int = 1) -> None:
    """How far ahead of the weight row being read the SIMD kernels prefetch, and into which
    cache level (0 = L1, 1 = L2, 2 = L3); process-wide, a tuning knob for benchmarks."""
    native().ft_set_prefetch(nbytes, level)
