"""Q8_0x8's block readers (resident's regrouped Q8_0, :mod:`freetoken.quant.q8_0x8`): eight
Q8_0 blocks of a row in a 272-byte group, their scales first, so values come 16 bytes a load.
Three readers of the same blocks: the float one (:func:`q8_0x8_rows`, q8_0's sums in these
places), :func:`q8_0x8_sums` (a block's products summed before its scale) and
:func:`q8_0x8_int8` (x quantised to int8 blocks, products summed as integers, as llama.cpp's
GPU kernels do). :mod:`.triton_gemv` picks one when a kernel is compiled.

Like the kernels, these helpers carry no type annotations (see :mod:`.triton_gemv`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton_blocks import as_f32, i8_f32


@triton.jit
def q8_0x8_blocks(w_ptr, base, ok, blocks, lane, BITS: tl.constexpr):
    """Q8_0 blocks ``blocks`` of the rows at ``base`` where Q8_0x8 keeps them: block b's scale
    at (b // 8) * 272 + 2 (b % 8), its values at (b // 8) * 272 + 16 + 32 (b % 8), both 16-byte
    aligned, so the values come 16 bytes a load. Returns the values (BLOCK_R, STEP, 32) and
    scales (BLOCK_R, STEP) as float32 (BITS: q8_0's integer conversion)."""
    group = base[:, None] + (blocks // 8)[None, :] * 272  # (BLOCK_R, STEP)
    d = tl.load((w_ptr + group).to(tl.pointer_type(tl.float16)) + (blocks % 8)[None, :],
                mask=ok, other=0.0).to(tl.float32)
    at = group + 16 + (blocks % 8)[None, :] * 32
    qb = tl.load(w_ptr + at[:, :, None] + lane[None, None, :], mask=ok[:, :, None],
                 other=0x80 if BITS else 0)
    return i8_f32(qb, BITS), d


@triton.jit
def _q8_0x8_step(w_ptr, base, row_ok, x_row, b0, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                 STEP: tl.constexpr, BITS: tl.constexpr):
    """Blocks b0 to b0 + STEP of the rows at ``base`` in Q8_0x8's places: their values
    (BLOCK_R, STEP, 32), scales (BLOCK_R, STEP) and x in the values' layout (read once per
    row, from L1), as float32."""
    lane = tl.arange(0, 32)
    blocks = b0 + tl.arange(0, STEP)
    ok = row_ok[:, None] & (blocks < NB * 8)[None, :]
    q, d = q8_0x8_blocks(w_ptr, base, ok, blocks, lane, BITS)
    xi = tl.broadcast_to(blocks[None, :, None] * 32 + lane[None, None, :], (BLOCK_R, STEP, 32))
    return q, d, as_f32(x_row, xi, ok[:, :, None], BITS)


@triton.jit
def q8_0x8_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                 STEP: tl.constexpr, BITS: tl.constexpr):
    # q8_0's loop and sums over its 32-weight blocks (STEP a step), in Q8_0x8's places
    acc = tl.zeros([BLOCK_R, STEP, 32], dtype=tl.float32)
    for b0 in range(0, NB * 8, STEP):
        q, d, x = _q8_0x8_step(w_ptr, base, row_ok, x_row, b0, NB, BLOCK_R, STEP, BITS)
        acc += q * (x * d[:, :, None])
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def q8_0x8_sums(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                STEP: tl.constexpr, BITS: tl.constexpr):
    """:func:`q8_0x8_rows` with each block's 32 products ``q * x`` summed first and the sum
    times the block's scale (one multiply-add a weight, the scale once a block): Q8_0x8's
    16-byte loads leave a thread 16 values of a block, so the sum is mostly in the thread.
    Other roundings than ``q * (x * d)``, so not that reader's bits."""
    acc = tl.zeros([BLOCK_R, STEP], dtype=tl.float32)
    for b0 in range(0, NB * 8, STEP):
        q, d, x = _q8_0x8_step(w_ptr, base, row_ok, x_row, b0, NB, BLOCK_R, STEP, BITS)
        acc += tl.sum(q * x, axis=2) * d
    return tl.sum(acc, axis=1)


@triton.jit
def dp4a(a, b, ASM: tl.constexpr):
    """The sum of the four products of ``a``'s and ``b``'s int8 bytes, as int32: the GPU's
    ``dp4a`` (ASM), else the same integers by shifts and multiplies (the interpreter's twin)."""
    if ASM:
        c = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, 0;", "=r,r,r", [a, b],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = ((a << 24) >> 24) * ((b << 24) >> 24)
        for k in tl.static_range(1, 4):
            c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
    return c


@triton.jit
def int8_blocks(x):
    """float32 x (..., 32): each 32-value block as int8 (four to an int32, (..., 8)) and its
    scale (...): ``d = max |x| / 127``, ``q = round(x / d)`` (half to even, by the float adder:
    ``2**23 + 2**22`` added puts the rounded integer in the low bits), 0 for a block of
    zeros. ``kernels/gather_gemv.py:int8_x_reference`` is its twin."""
    amax = tl.max(tl.abs(x), axis=len(x.shape) - 1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = (x * tl.expand_dims(inv, len(x.shape) - 1) + 12582912.0).to(
        tl.int32, bitcast=True) - 0x4B400000
    four = tl.reshape(q, x.shape[:-1] + [8, 4]) & 0xFF
    shift = tl.arange(0, 4) * 8
    return tl.sum(four << shift, axis=len(x.shape)), amax / 127.0


@triton.jit
def q8_0x8_words(w_ptr, group, blocks, ok):
    """Q8_0x8 blocks ``blocks`` of the rows whose groups start at ``group`` ((BLOCK_R, STEP)
    byte offsets): their values as int32 words of four (BLOCK_R, STEP, 8) and their scales
    (BLOCK_R, STEP) as float32."""
    d = tl.load((w_ptr + group).to(tl.pointer_type(tl.float16)) + (blocks % 8)[None, :],
                mask=ok, other=0.0).to(tl.float32)
    at = (w_ptr + group + 16 + (blocks % 8)[None, :] * 32).to(tl.pointer_type(tl.int32))
    q = tl.load(at[:, :, None] + tl.arange(0, 8)[None, None, :], mask=ok[:, :, None], other=0)
    return q, d


@triton.jit
def q8_0x8_int8(w_ptr, base, up_base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                STEP: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, UP: tl.constexpr):
    """Q8_0x8's rows against x quantised to int8 per 32-value block (:func:`int8_blocks`), as
    llama.cpp's GPU kernels do: a block's 32 products summed as integers, four an instruction
    (:func:`dp4a`), then times both scales. Far fewer instructions a weight than the float
    readers; other values: x's rounding to 1/254 of its block's largest. With UP also the
    rows at ``up_base`` on the same quantised x (gate's and up's); returns both sums."""
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_R, STEP], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_R, STEP], dtype=tl.float32)
    for b0 in range(0, NB * 8, STEP):
        blocks = b0 + tl.arange(0, STEP)
        live = blocks < NB * 8
        ok = row_ok[:, None] & live[None, :]
        xq, xd = int8_blocks(as_f32(x_row, blocks[:, None] * 32 + lane[None, :], live[:, None],
                                    BITS))
        step = (blocks // 8)[None, :] * 272
        q, d = q8_0x8_words(w_ptr, base[:, None] + step, blocks, ok)
        acc += tl.sum(dp4a(q, xq[None, :, :], ASM), axis=2).to(tl.float32) * (d * xd[None, :])
        if UP:
            q, d = q8_0x8_words(w_ptr, up_base[:, None] + step, blocks, ok)
            acc_up += tl.sum(dp4a(q, xq[None, :, :], ASM), axis=2).to(tl.float32) * (
                d * xd[None, :])
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)
