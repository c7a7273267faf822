"""RMSNorm as one GPU kernel (Triton) instead of torch's five (pow, mean, add, rsqrt, mul):
every layer runs two to four norms a token, and at decode each launch costs more than its
arithmetic. Its slow twin is ``layers/norm.py:RMSNorm.reference``; the sum of squares is
taken in the kernel's own order, so the two agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

MODES = {"qwen": 0, "unit_offset": 1, "float_scale": 2}  # how the scale is applied
MAX_DIM = 16384  # one row per program, held in registers
_failed: list[str] = []  # the first build failure, once logged; the torch path from then on


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` takes these: a GPU row of at most MAX_DIM, the weight in x's
    dtype (so the output dtype is the torch path's), and no earlier build failure."""
    return (x.is_cuda and not _failed and x.dtype == w.dtype and x.shape[-1] == w.numel()
            <= MAX_DIM)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, mode: str) -> torch.Tensor | None:
    """x (..., dim) normalised and scaled by w (dim,) as ``mode`` says; None when the kernel
    failed to build (logged once; the caller takes the torch path)."""
    import triton

    from freetoken.kernels import triton_norm
    from freetoken.kernels.gather_gemv import raised_by_triton

    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(dim)
    try:
        triton_norm.rms_norm[(rows.shape[0],)](
            rows, w, out, dim, rows.stride(0), out.stride(0), eps, MODE=MODES[mode],
            BLOCK=block, num_warps=max(1, min(8, block // 256)))
    except Exception as e:  # noqa: BLE001 - only Triton's own failures are caught
        if not raised_by_triton(e):
            raise
        _failed.append(f"{type(e).__name__}: {e}")
        log.warning("the fused RMSNorm kernel failed to build (%s); norms take the torch path",
                    _failed[0])
        return None
    return out.view(x.shape)
