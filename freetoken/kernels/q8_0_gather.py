"""Q8_0 experts gathered and multiplied in one pass on the GPU (Triton), for decode.

A decode call's (token, expert) pairs each read one expert's weights: in the expert cache those
are Q8_0 blocks (``d: f16 | qs: int8[32]``, 34 bytes) in the slots. The slow twin
(:func:`gathered_q8_0_reference`) copies the pairs' slots out, dequantises them to the compute
dtype and runs batched matmuls: about 8 bytes moved per weight. The fused kernel reads each
weight's byte once, straight from its slot, and accumulates in float32: one program per pair
and block of output rows, the activation row broadcast over them.

Shapes: P pairs = T tokens x A active; pair p is token p // A's. Weights of a projection:
``data`` uint8 (S, R, K // 32 * 34), S slots (or experts), R output rows, K inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from freetoken.quant import QuantTensor, dequantize_as

BLOCK_ROWS = 16  # output rows per program: enough programs to fill the GPU at one token
BLOCKS_PER_STEP = 4  # Q8_0 blocks (of 32 inputs) per row per loop step

Act = Callable[[torch.Tensor], torch.Tensor]
_kernel: Any = None  # built on first use (triton imported lazily: CPU installs need not have it)


def unavailable() -> str | None:
    """Why the fused kernel cannot run here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def q8_0_gather_gemv(qs_ptr, d_ptr, index_ptr, x_ptr, out_ptr, R, per,
                         slot_stride, row_stride, x_stride, out_stride,
                         NB: tl.constexpr, BLOCK_R: tl.constexpr, STEP: tl.constexpr):
        p = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        slot = tl.load(index_ptr + p).to(tl.int64)
        row_base = slot * slot_stride + rows.to(tl.int64) * row_stride  # bytes
        x_row = x_ptr + (p // per) * x_stride
        acc = tl.zeros([BLOCK_R], dtype=tl.float32)
        lane = tl.arange(0, 32)
        for b0 in range(0, NB, STEP):
            blocks = b0 + tl.arange(0, STEP)
            block_ok = blocks < NB
            block_base = row_base[:, None] + blocks[None, :] * 34  # (BLOCK_R, STEP)
            ok = row_ok[:, None] & block_ok[None, :]
            d = tl.load(d_ptr + block_base // 2, mask=ok, other=0.0).to(tl.float32)
            q = tl.load(qs_ptr + block_base[:, :, None] + 2 + lane[None, None, :],
                        mask=ok[:, :, None], other=0).to(tl.float32)
            x = tl.load(x_row + blocks[:, None] * 32 + lane[None, :],
                        mask=block_ok[:, None], other=0.0).to(tl.float32)  # (STEP, 32)
            acc += tl.sum(tl.sum(q * x[None, :, :], axis=2) * d, axis=1)
        tl.store(out_ptr + p * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    return q8_0_gather_gemv


def q8_0_gather_gemv(data: torch.Tensor, index: torch.Tensor, x: torch.Tensor,
                     per: int) -> torch.Tensor:
    """``out[p] = W[index[p]] @ x[p // per]`` for Q8_0 ``data`` (S, R, K // 32 * 34) uint8
    (any slot and row strides, 2-byte aligned), ``index`` (P,) int64, ``x`` (N, K).
    Returns (P, R) in ``x``'s dtype."""
    global _kernel
    import triton

    if _kernel is None:
        _kernel = _build()
    S, R, row_bytes = data.shape
    NB = row_bytes // 34
    if data.dtype != torch.uint8 or row_bytes % 34 or data.stride(2) != 1:
        raise ValueError(f"Q8_0 data must be uint8 rows of 34-byte blocks, got {data.dtype} "
                         f"{tuple(data.shape)} strides {data.stride()}")
    if x.shape[1] != NB * 32 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} does not fit {NB * 32} inputs")
    if (data.storage_offset() | data.stride(0) | data.stride(1)) % 2:
        raise ValueError("Q8_0 data must be 2-byte aligned (its f16 scales are read in place)")
    # one storage, two typed views: the int8 values and the f16 scales, both addressed in bytes
    # from the storage start (the f16 view halves them)
    base = data.as_strided((data.untyped_storage().nbytes(),), (1,), 0)
    qs, d = base.view(torch.int8), base.view(torch.float16)
    start = data.storage_offset()
    P = index.numel()
    out = torch.empty(P, R, dtype=x.dtype, device=x.device)
    grid = (P, triton.cdiv(R, BLOCK_ROWS))
    _kernel[grid](qs[start:], d[start // 2:], index, x, out, R, per,
                  data.stride(0), data.stride(1), x.stride(0), out.stride(0),
                  NB=NB, BLOCK_R=BLOCK_ROWS, STEP=BLOCKS_PER_STEP)
    return out


def gathered_q8_0(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor, gate: QuantTensor,
                  up: QuantTensor, down: QuantTensor, act: Act) -> torch.Tensor:
    """Pairs at once, as ``resident.gathered``, with each pair's expert ``index[p]`` read from
    the Q8_0 stacks gate/up (S, I, H) and down (S, H, I). x (T, H), w (T, A) -> (T, H)."""
    T, A = w.shape
    g = q8_0_gather_gemv(gate.data, index, x, A)
    u = q8_0_gather_gemv(up.data, index, x, A)
    y = q8_0_gather_gemv(down.data, index, act(g) * u, 1)  # (T*A, H)
    return (y.view(T, A, -1) * w.unsqueeze(-1).to(y.dtype)).sum(1)


def gathered_q8_0_reference(x: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
                            gate: QuantTensor, up: QuantTensor, down: QuantTensor,
                            act: Act) -> torch.Tensor:
    """Slow twin: the pairs' experts copied out, dequantised to ``x``'s dtype, batched
    matmuls (``resident.gathered``)."""
    from freetoken.moe.resident import gathered

    def picked(qt: QuantTensor) -> torch.Tensor:
        sub = QuantTensor(qt.fmt, (index.numel(), *qt.shape[1:]), qt.data[index],
                          {k: s[index] for k, s in qt.scales.items()})
        return dequantize_as(sub, x.dtype)

    return gathered(x, w, picked(gate), picked(up), picked(down), act)
