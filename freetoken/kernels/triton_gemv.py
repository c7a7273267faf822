"""The Triton kernel of :mod:`freetoken.kernels.gather_gemv`, compiled once per weight format
(FMT; imported only when first used: triton is needed on GPU machines, not on CPU installs).

The kernel: ``out[p, rows] = W[index[p]][rows] @ x[p // per]`` for one pair p (program axis
0) and BLOCK_R output rows (axis 1), W's blocks read from uint8 ``w_ptr`` at ``slot * slot_stride
+ row * row_stride`` bytes, NB blocks per row, float32 accumulation. With ACT (a gate and up
stack of 2R rows, up's after gate's): ``out[p, rows] = act(gate rows) * (up rows)``, the two
sums and the product in float32, rounded once (ACT 1 silu, 2 tanh-approximated gelu). With
INT8_X (Q8_0x8) x is quantised to int8 blocks and the blocks' products summed as integers
(``triton_q8_0x8.q8_0x8_int8``; ASM: with the GPU's dp4a, else its twin in shifts).

``weigh_sum`` weighs a token's pair outputs and sums them, one launch for torch's two.

``gather_gemv_scaled`` is the same for a format whose scales are kept apart from its codes
(nvfp4): a scale byte per block at ``slot * s_slot_stride + row * s_row_stride + block`` of
``s_ptr``, a global scale per slot at ``g_ptr + slot * g_slot_stride``; with ACT, up's
codes and scales come through pointers of their own (the same strides), not after gate's.

The helpers carry no type annotations: compiled code may read only constexpr globals, and the
compiler counts an annotation such as ``Any`` as a read (the interpreter does not).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton_blocks import as_f32, block_rows
from freetoken.kernels.triton_overlap import inputs_ready
from freetoken.kernels.triton_q8_0x8 import (
    dp4a,
    int8_blocks,
    q8_0x8_blocks,
    q8_0x8_int8,
    q8_0x8_rows,
    q8_0x8_sums,
    q8_0x8_words,
)


@triton.jit
def _pair_rows(index_ptr, x_ptr, R, per, slot_stride, row_stride, x_stride,
               BLOCK_R: tl.constexpr):
    """This program's pair p, its block of output rows (and which of them exist), the rows'
    byte offsets in the pair's slot, and the pair's activation row."""
    p = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    base = tl.load(index_ptr + p).to(tl.int64) * slot_stride + rows.to(tl.int64) * row_stride
    return p, rows, rows < R, base, x_ptr + (p // per) * x_stride


@triton.jit
def _glu(g, u, ACT: tl.constexpr):
    """act(g) * u in float32: ACT 1 silu, 2 gelu with the tanh approximation."""
    if ACT == 1:
        a = g / (1.0 + tl.exp(-g))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        a = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * z)))  # 1 + tanh(z)
    return a * u


@triton.jit
def _rows(FMT: tl.constexpr, w_ptr, base, row_ok, x_row, NB: tl.constexpr,
          BLOCK_R: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr, SUMS: tl.constexpr):
    """The rows' sums: Q8_0x8's (with SUMS each block's products summed before its scale),
    else the format's reader."""
    if SUMS:
        acc = q8_0x8_sums(w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    elif FMT == "q8_0x8":
        acc = q8_0x8_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    else:
        acc = block_rows(FMT, w_ptr, w_ptr, base, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    return acc


@triton.jit
def gather_gemv(w_ptr, index_ptr, x_ptr, out_ptr, R, per, slot_stride, row_stride, x_stride,
                out_stride, FMT: tl.constexpr, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                STEP: tl.constexpr, ACT: tl.constexpr, BITS: tl.constexpr = False,
                PDL: tl.constexpr = False, SUMS: tl.constexpr = False,
                INT8_X: tl.constexpr = False, ASM: tl.constexpr = False):
    inputs_ready(PDL)
    p, rows, row_ok, base, x_row = _pair_rows(index_ptr, x_ptr, R, per, slot_stride, row_stride,
                                              x_stride, BLOCK_R)
    up_base = base + R * row_stride  # with ACT: up's rows, after gate's
    if INT8_X:  # Q8_0x8 only: x as int8 blocks once for gate's and up's rows
        acc, up = q8_0x8_int8(w_ptr, base, up_base, row_ok, x_row, NB, BLOCK_R, STEP, BITS, ASM,
                              ACT > 0)
    else:
        acc = _rows(FMT, w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS, SUMS)
        up = acc  # both branches define it: the compiler joins them
        if ACT:
            up = _rows(FMT, w_ptr, up_base, row_ok, x_row, NB, BLOCK_R, STEP, BITS, SUMS)
    if ACT:
        acc = _glu(acc, up, ACT)
    tl.store(out_ptr + p * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def weigh_sum(y_ptr, w_ptr, slot_ptr, out_ptr, H, y_stride, out_stride, A: tl.constexpr,
              BLOCK: tl.constexpr, MASK: tl.constexpr, PDL: tl.constexpr = False):
    """``out[t, cols] = sum_a w[t, a] * y[t * A + a, cols]`` with torch's roundings of
    ``weigh_pairs``: w and each product rounded to out's dtype, summed in float32 (pair
    order), rounded once. MASK: a pair whose ``slot`` is negative adds nothing (not read)."""
    inputs_ready(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for a in tl.static_range(A):
        w = tl.load(w_ptr + t * A + a).to(dt).to(tl.float32)
        live = ok
        if MASK:  # a pair without a slot: its row is not read, its product is 0
            live = ok & ((cols * 0 + tl.load(slot_ptr + t * A + a)) >= 0)  # a block mask
        y = tl.load(y_ptr + (t * A + a) * y_stride + cols, mask=live, other=0.0).to(tl.float32)
        acc += tl.where(live, (y * w).to(dt).to(tl.float32), 0.0)
    tl.store(out_ptr + t * out_stride + cols, acc.to(dt), mask=ok)


@triton.jit
def gather_gemv_scaled(w_ptr, s_ptr, g_ptr, wu_ptr, su_ptr, gu_ptr, index_ptr, x_ptr, out_ptr,
                       R, per, slot_stride, row_stride, s_slot_stride, s_row_stride,
                       g_slot_stride, x_stride, out_stride, FMT: tl.constexpr,
                       NB: tl.constexpr, BLOCK_R: tl.constexpr, STEP: tl.constexpr,
                       ACT: tl.constexpr, BITS: tl.constexpr = False, PDL: tl.constexpr = False):
    """:func:`gather_gemv` for codes with scales apart (module docstring); the row sums times
    the slot's global scale. With ACT, up's codes, scales and global scales at wu_ptr, su_ptr
    and gu_ptr."""
    inputs_ready(PDL)
    p, rows, row_ok, base, x_row = _pair_rows(index_ptr, x_ptr, R, per, slot_stride, row_stride,
                                              x_stride, BLOCK_R)
    slot = tl.load(index_ptr + p).to(tl.int64)
    s_base = slot * s_slot_stride + rows.to(tl.int64) * s_row_stride
    acc = block_rows(FMT, w_ptr, s_ptr, base, s_base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    acc = acc * tl.load(g_ptr + slot * g_slot_stride).to(tl.float32)
    if ACT:
        up = block_rows(FMT, wu_ptr, su_ptr, base, s_base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
        acc = _glu(acc, up * tl.load(gu_ptr + slot * g_slot_stride).to(tl.float32), ACT)
    tl.store(out_ptr + p * out_stride + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def dense_gemv(w_ptr, x_ptr, out_ptr, R, T, row_stride, x_stride, out_stride,
               NB: tl.constexpr, BLOCK_R: tl.constexpr, STEP: tl.constexpr, TOK: tl.constexpr,
               BITS: tl.constexpr = False, PDL: tl.constexpr = False,
               SUMS: tl.constexpr = False, INT8_X: tl.constexpr = False,
               ASM: tl.constexpr = False):
    """``out[t, rows] = W[rows] @ x[t]`` for the T <= TOK rows of x: one Q8_0x8 matrix (a dense
    layer at decode) read once for all of them, each product q8_0's ``q * (x * d)``; with
    SUMS a block's products ``q * x`` summed before its scale (as ``q8_0x8_sums``); with
    INT8_X each row of x as int8 blocks and a block's products summed as integers (as
    ``q8_0x8_int8``)."""
    inputs_ready(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    base = rows.to(tl.int64) * row_stride
    toks = tl.arange(0, TOK)
    lane = tl.arange(0, 32)
    acc = tl.zeros([TOK, BLOCK_R, STEP, 32], dtype=tl.float32)
    block_acc = tl.zeros([TOK, BLOCK_R, STEP], dtype=tl.float32)
    for b0 in range(0, NB * 8, STEP):
        blocks = b0 + tl.arange(0, STEP)
        live = blocks < NB * 8
        ok = row_ok[:, None] & live[None, :]
        xi = toks[:, None, None] * x_stride + blocks[None, :, None] * 32 + lane[None, None, :]
        x = as_f32(x_ptr, xi, (toks < T)[:, None, None] & live[None, :, None], BITS)
        if INT8_X:
            xq, xd = int8_blocks(x)  # (TOK, STEP, 8), (TOK, STEP)
            q, d = q8_0x8_words(w_ptr, base[:, None] + (blocks // 8)[None, :] * 272, blocks, ok)
            dots = tl.sum(dp4a(q[None], xq[:, None], ASM), axis=3).to(tl.float32)
            block_acc += dots * (d[None] * xd[:, None])
        else:
            q, d = q8_0x8_blocks(w_ptr, base, ok, blocks, lane, BITS)
            if SUMS:
                block_acc += tl.sum(q[None] * x[:, None], axis=3) * d[None]
            else:
                acc += q[None] * (x[:, None] * d[None, :, :, None])
    if SUMS or INT8_X:
        out = tl.sum(block_acc, axis=2)  # (TOK, BLOCK_R)
    else:
        out = tl.sum(tl.sum(acc, axis=3), axis=2)
    tl.store(out_ptr + toks[:, None] * out_stride + rows[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(toks < T)[:, None] & row_ok[None, :])
