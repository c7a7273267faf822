"""The Triton kernel of :mod:`freetoken.kernels.rms_norm` (imported only when first used:
triton is needed on GPU machines, not on CPU installs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm(x_ptr, w_ptr, out_ptr, dim, x_stride, out_stride, eps, MODE: tl.constexpr,
             BLOCK: tl.constexpr):
    """One row per program: h = x / rms(x) in float32; MODE 0 (Qwen) w * h rounded to the
    output dtype first, 1 (Gemma) h * (1 + w), 2 (plain float scale) h * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    h = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if MODE == 0:
        y = w * h.to(out_ptr.dtype.element_ty).to(tl.float32)
    elif MODE == 1:
        y = h * (1.0 + w)
    else:
        y = h * w
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)
