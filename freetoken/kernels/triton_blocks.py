"""The weight formats' block readers of :mod:`freetoken.kernels.triton_gemv`: BLOCK_R rows of
one matrix, each format's blocks decoded and summed against x in float32 (``block_rows`` picks
the format when a kernel is compiled). Scales are read as f16 and codes as bytes at byte
pointers; BITS makes the int8 and bf16 conversions with integer instructions (``i8_f32``,
``as_f32``), not the GPU's slower conversions.

Like the kernels, these helpers carry no type annotations (see :mod:`.triton_gemv`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f16(ptr, mask):
    """Little-endian f16s at byte pointers ``ptr``, as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def as_f32(x_row, offs, mask, BITS: tl.constexpr):
    """x at ``x_row + offs`` as float32; with BITS a bf16 x becomes the high half of its
    float32 by a shift, not a conversion instruction."""
    if BITS and x_row.dtype.element_ty == tl.bfloat16:
        raw = tl.load(x_row.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        return (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def i8_f32(qb, BITS: tl.constexpr):
    """Bytes holding int8 values, as float32. BITS: as 2**23 + 128 + q (the byte with its sign
    bit flipped, under 2**23's exponent) less 2**23 + 128, the same values with integer and
    add instructions instead of the GPU's slower conversions."""
    if BITS:
        q = ((qb.to(tl.int32) ^ 0x80) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    else:
        q = qb.to(tl.int8, bitcast=True).to(tl.float32)
    return q


@triton.jit
def _q8_0_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
               STEP: tl.constexpr, BITS: tl.constexpr):
    # every product kept in its own lane until the loop ends: one reduction across threads
    # per row instead of one per block (BITS: i8_f32)
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_R, STEP, 32], dtype=tl.float32)
    for b0 in range(0, NB, STEP):  # d: f16 | qs: int8[32]
        blocks = b0 + tl.arange(0, STEP)
        ok = row_ok[:, None] & (blocks < NB)[None, :]
        at = base[:, None] + blocks[None, :] * 34  # (BLOCK_R, STEP)
        d = _f16(w_ptr + at, ok)
        qb = tl.load(w_ptr + at[:, :, None] + 2 + lane[None, None, :], mask=ok[:, :, None],
                     other=0x80 if BITS else 0)
        q = i8_f32(qb, BITS)
        # x read once per row (from L1) lands in q's layout: no exchange between threads
        xi = tl.broadcast_to(blocks[None, :, None] * 32 + lane[None, None, :], (BLOCK_R, STEP, 32))
        x = as_f32(x_row, xi, ok[:, :, None], BITS)
        acc += q * (x * d[:, :, None])
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _q5_0_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
               STEP: tl.constexpr):
    half = tl.arange(0, 2)[:, None]  # weight i = 16 * half + j: qs[j]'s low or high nibble
    j = tl.arange(0, 16)[None, :]
    i = 16 * half + j  # (2, 16)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for b0 in range(0, NB, STEP):  # d: f16 | qh: u8[4] | qs: u8[16]
        blocks = b0 + tl.arange(0, STEP)
        ok = row_ok[:, None] & (blocks < NB)[None, :]
        at = base[:, None] + blocks[None, :] * 22  # (BLOCK_R, STEP)
        d = _f16(w_ptr + at, ok)
        at4 = at[:, :, None, None]
        ok4 = ok[:, :, None, None]
        qs = tl.load(w_ptr + at4 + 6 + j[None, None], mask=ok4, other=0).to(tl.int32)
        qh = tl.load(w_ptr + at4 + 2 + (i // 8)[None, None], mask=ok4, other=0).to(tl.int32)
        q = ((qs >> (4 * half[None, None])) & 15) | (((qh >> (i % 8)[None, None]) & 1) << 4)
        x = tl.load(
            x_row + blocks[:, None, None] * 32 + i[None],
            mask=(blocks < NB)[:, None, None],
            other=0.0,
        ).to(tl.float32)  # (STEP, 2, 16)
        dot = tl.sum(tl.sum((q.to(tl.float32) - 16.0) * x[None], axis=3), axis=2)
        acc += tl.sum(dot * d, axis=1)
    return acc




@triton.jit
def _e2m1_doubled(code, BITS: tl.constexpr):
    """Twice an e2m1 code's value (``quant/mxfp4.py``'s table): the magnitudes of m = 7..0
    (12, 8, 6, 4, 3, 2, 1, 0) are the nibbles of one word, the sign is bit 3. BITS: the
    magnitude made float32 under 2**23's exponent and the sign bit set by integer
    instructions, as q8_0's (the same values)."""
    m = (0x0123468C >> (((code & 7) ^ 7) * 4)) & 15
    if BITS:
        v = (m | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        signed = v.to(tl.int32, bitcast=True) ^ ((code & 8) << 28)
        return signed.to(tl.float32, bitcast=True)
    else:
        v = m.to(tl.float32)
        return tl.where(code >= 8, -v, v)


@triton.jit
def _mxfp4_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr,
                STEP: tl.constexpr, BITS: tl.constexpr):
    # as q8_0's: products kept apart until the loop ends
    j = tl.arange(0, 16)  # qs[j]: weight j (low nibble) and j + 16 (high)
    acc = tl.zeros([BLOCK_R, STEP, 16], dtype=tl.float32)
    for b0 in range(0, NB, STEP):  # e: u8 | qs: u8[16]
        blocks = b0 + tl.arange(0, STEP)
        ok = row_ok[:, None] & (blocks < NB)[None, :]
        at = base[:, None] + blocks[None, :] * 17  # (BLOCK_R, STEP)
        e = tl.load(w_ptr + at, mask=ok, other=0).to(tl.int32)
        # 2**(e - 128), exact for every byte (0 and 1: subnormals)
        half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        qs = tl.load(w_ptr + at[:, :, None] + 1 + j[None, None, :], mask=ok[:, :, None],
                     other=0).to(tl.int32)
        xi = tl.broadcast_to(blocks[None, :, None] * 32 + j[None, None, :], (BLOCK_R, STEP, 16))
        x_lo = as_f32(x_row, xi, ok[:, :, None], BITS)
        x_hi = as_f32(x_row, xi + 16, ok[:, :, None], BITS)
        dot = _e2m1_doubled(qs & 15, BITS) * x_lo + _e2m1_doubled(qs >> 4, BITS) * x_hi
        acc += dot * half[:, :, None]
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _e4m3(b):
    """e4m3 bytes (int32) as float32, exact: exponent and mantissa shifted into float32's
    places under bias 120 give 2**(e - 7) * (1 + m / 8); for e = 0 (subnormal: m * 2**-9)
    that is 2**-7 * (1 + m / 8), so twice it less 2**-6. Bit 7 the sign; 0x7F (NaN) reads
    as 480."""
    v = (((b & 0x7F) << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    v = tl.where((b & 0x78) == 0, 2.0 * v - 0.015625, v)
    return (v.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_rows(w_ptr, s_ptr, base, s_base, row_ok, x_row, NB: tl.constexpr,
                BLOCK_R: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    # mxfp4's sums over 16-weight blocks: codes u8[8] a block along the row (byte j: weight
    # 2j in the low nibble, 2j + 1 in the high), one e4m3 scale byte a block apart from them;
    # the row's sum without the global scale
    j = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_R, STEP, 8], dtype=tl.float32)
    for b0 in range(0, NB, STEP):
        blocks = b0 + tl.arange(0, STEP)
        ok = row_ok[:, None] & (blocks < NB)[None, :]
        sb = tl.load(s_ptr + s_base[:, None] + blocks[None, :], mask=ok, other=0)
        d = _e4m3(sb.to(tl.int32))  # (BLOCK_R, STEP)
        at = base[:, None] + blocks[None, :] * 8
        qs = tl.load(w_ptr + at[:, :, None] + j[None, None, :], mask=ok[:, :, None],
                     other=0).to(tl.int32)
        xi = tl.broadcast_to(blocks[None, :, None] * 16 + 2 * j[None, None, :], (BLOCK_R, STEP, 8))
        x_lo = as_f32(x_row, xi, ok[:, :, None], BITS)
        x_hi = as_f32(x_row, xi + 1, ok[:, :, None], BITS)
        dot = _e2m1_doubled(qs & 15, BITS) * x_lo + _e2m1_doubled(qs >> 4, BITS) * x_hi
        acc += dot * d[:, :, None]
    return tl.sum(tl.sum(acc, axis=2), axis=1) * 0.5  # the codes' values were doubled


@triton.jit
def _k4_scale_min(at, s, ok):
    """Six-bit scale and min of sub-blocks ``s`` (scales: a = [0:4], b = [4:8], c = [8:12]
    after the two f16s) for the rows whose blocks start at ``at``."""
    lo = (s % 4)[None, :]
    a = tl.load(at[:, None] + 4 + lo, mask=ok[:, None], other=0)
    b = tl.load(at[:, None] + 8 + lo, mask=ok[:, None], other=0)
    c = tl.load(at[:, None] + 12 + lo, mask=ok[:, None], other=0)
    first = (s < 4)[None, :]
    sc = tl.where(first, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(first, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_block(acc, x_at, k, lane, q_lo, q_hi, d, dmin, sc_lo, mn_lo, sc_hi, mn_hi):
    """``acc`` plus one q4_k / q5_k super-block of its rows: chunk k's sub-blocks 2k (codes
    ``q_lo``) and 2k + 1 (``q_hi``), each (BLOCK_R, 4, 32), against x at ``x_at`` (the
    block's 256 values), ``d * scale * dot - dmin * min * sum(x)`` per sub-block."""
    x_lo = tl.load(x_at + k[:, None] * 64 + lane[None, :]).to(tl.float32)
    x_hi = tl.load(x_at + k[:, None] * 64 + 32 + lane[None, :]).to(tl.float32)
    dot_lo = tl.sum(q_lo.to(tl.float32) * x_lo[None], axis=2)  # (BLOCK_R, 4)
    dot_hi = tl.sum(q_hi.to(tl.float32) * x_hi[None], axis=2)
    sum_lo = tl.sum(x_lo, axis=1)[None, :]
    sum_hi = tl.sum(x_hi, axis=1)[None, :]
    acc += d * tl.sum(sc_lo * dot_lo + sc_hi * dot_hi, axis=1)
    acc -= dmin * tl.sum(mn_lo * sum_lo + mn_hi * sum_hi, axis=1)
    return acc


@triton.jit
def _q4_k_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr):
    k = tl.arange(0, 4)  # qs chunk k: sub-block 2k (low nibbles), 2k + 1 (high)
    lane = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for b in range(NB):  # d, dmin: f16 | scales: u8[12] | qs: u8[128]
        at = w_ptr + base + b * 144  # (BLOCK_R,) pointers
        d = _f16(at, row_ok)
        dmin = _f16(at + 2, row_ok)
        sc_lo, mn_lo = _k4_scale_min(at, 2 * k, row_ok)
        sc_hi, mn_hi = _k4_scale_min(at, 2 * k + 1, row_ok)
        qs = tl.load(
            at[:, None, None] + 16 + k[None, :, None] * 32 + lane[None, None, :],
            mask=row_ok[:, None, None],
            other=0,
        )
        acc = _k_block(acc, x_row + b * 256, k, lane, qs & 15, qs >> 4, d, dmin, sc_lo, mn_lo,
                       sc_hi, mn_hi)
    return acc


@triton.jit
def _q5_k_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr):
    # q4_k's sub-blocks and nibbles; weight l of sub-block j adds 16 where qh[l] has bit j
    k = tl.arange(0, 4)  # qs chunk k: sub-block 2k (low nibbles), 2k + 1 (high)
    k3 = k[None, :, None]
    lane = tl.arange(0, 32)
    ok = row_ok[:, None, None]
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for b in range(NB):  # d, dmin: f16 | scales: u8[12] | qh: u8[32] | qs: u8[128]
        at = w_ptr + base + b * 176  # (BLOCK_R,) pointers
        d = _f16(at, row_ok)
        dmin = _f16(at + 2, row_ok)
        sc_lo, mn_lo = _k4_scale_min(at, 2 * k, row_ok)
        sc_hi, mn_hi = _k4_scale_min(at, 2 * k + 1, row_ok)
        at3 = at[:, None, None]
        qh = tl.load(at3 + 16 + lane[None, None, :], mask=ok, other=0).to(tl.int32)
        qs = tl.load(at3 + 48 + k3 * 32 + lane[None, None, :], mask=ok, other=0).to(tl.int32)
        q_lo = (qs & 15) | (((qh >> (2 * k3)) & 1) << 4)  # (BLOCK_R, 4, 32)
        q_hi = (qs >> 4) | (((qh >> (2 * k3 + 1)) & 1) << 4)
        acc = _k_block(acc, x_row + b * 256, k, lane, q_lo, q_hi, d, dmin, sc_lo, mn_lo, sc_hi,
                       mn_hi)
    return acc


@triton.jit
def _q6_k_rows(w_ptr, base, row_ok, x_row, NB: tl.constexpr, BLOCK_R: tl.constexpr):
    # weight 128 h + 32 s + 16 u + v (half h, quarter s, sub-block 8 h + 2 s + u)
    h = tl.arange(0, 2)[:, None, None]
    u = tl.arange(0, 2)[None, :, None]
    v = tl.arange(0, 16)[None, None, :]
    ok = row_ok[:, None, None, None]
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for b in range(NB):  # ql: u8[128] | qh: u8[64] | scales: i8[16] | d: f16
        at = base + b * 210
        d = _f16(w_ptr + at + 208, row_ok)
        at4 = at[:, None, None, None]
        qh = tl.load(w_ptr + at4 + 128 + (32 * h + 16 * u + v)[None], mask=ok, other=0)
        part = tl.zeros([BLOCK_R], dtype=tl.float32)
        for s in tl.static_range(4):
            ql = tl.load(w_ptr + at4 + (64 * h + 32 * (s % 2) + 16 * u + v)[None], mask=ok, other=0)
            q = ((ql >> (4 * (s // 2))) & 15) | (((qh >> (2 * s)) & 3) << 4)
            x = tl.load(x_row + b * 256 + 128 * h + 32 * s + 16 * u + v).to(tl.float32)
            dot = tl.sum((q.to(tl.float32) - 32.0) * x[None], axis=3)  # (BLOCK_R, 2, 2)
            sub = 8 * tl.arange(0, 2)[:, None] + 2 * s + tl.arange(0, 2)[None, :]  # (h, u)
            sc = tl.load(
                w_ptr + at[:, None, None] + 192 + sub[None], mask=row_ok[:, None, None], other=0
            ).to(tl.int8, bitcast=True)
            part += tl.sum(tl.sum(sc.to(tl.float32) * dot, axis=2), axis=1)
        acc += d * part
    return acc


@triton.jit
def block_rows(FMT: tl.constexpr, w_ptr, s_ptr, base, s_base, row_ok, x_row, NB: tl.constexpr,
          BLOCK_R: tl.constexpr, STEP: tl.constexpr, BITS: tl.constexpr):
    """The rows' sums of format FMT (chosen when the kernel is compiled); ``s_ptr + s_base``:
    the rows' scales where the format keeps them apart (nvfp4), unread otherwise."""
    if FMT == "nvfp4":
        acc = _nvfp4_rows(w_ptr, s_ptr, base, s_base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    elif FMT == "q8_0":
        acc = _q8_0_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    elif FMT == "mxfp4":
        acc = _mxfp4_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP, BITS)
    elif FMT == "q5_0":
        acc = _q5_0_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R, STEP)
    elif FMT == "q4_k":
        acc = _q4_k_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R)
    elif FMT == "q5_k":
        acc = _q5_k_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R)
    else:
        acc = _q6_k_rows(w_ptr, base, row_ok, x_row, NB, BLOCK_R)
    return acc
