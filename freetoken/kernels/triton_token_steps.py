"""The Triton kernels of :mod:`freetoken.kernels.token_steps` (RMSNorm, rotary embedding, the
two as one for attention's q and k, routing),
imported only when first used: triton is needed on GPU machines, not on CPU installs."""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton_overlap import inputs_ready


@triton.jit
def _scaled(h, w, dt: tl.constexpr, MODE: tl.constexpr):
    """Normalised values h scaled by w as :func:`rms_norm`'s MODE says, float32 (Qwen's h
    rounded to dt first)."""
    if MODE == 0:
        y = w * h.to(dt).to(tl.float32)
    elif MODE == 1:
        y = h * (1.0 + w)
    else:
        y = h * w
    return y


@triton.jit
def _rotated(lo, hi, cos_ptr, sin_ptr, pos, i, ok, dt: tl.constexpr, HALF: tl.constexpr,
             ROUND: tl.constexpr):
    """A head's halves (float32) rotated at ``pos`` as :func:`rotary_neox` says."""
    c_lo = tl.load(cos_ptr + pos * 2 * HALF + i, mask=ok, other=0.0)
    c_hi = tl.load(cos_ptr + pos * 2 * HALF + HALF + i, mask=ok, other=0.0)
    s_lo = tl.load(sin_ptr + pos * 2 * HALF + i, mask=ok, other=0.0)
    s_hi = tl.load(sin_ptr + pos * 2 * HALF + HALF + i, mask=ok, other=0.0)
    if ROUND:
        c_lo, c_hi = c_lo.to(dt).to(tl.float32), c_hi.to(dt).to(tl.float32)
        s_lo, s_hi = s_lo.to(dt).to(tl.float32), s_hi.to(dt).to(tl.float32)
        y_lo = (lo * c_lo).to(dt).to(tl.float32) + (-hi * s_lo).to(dt).to(tl.float32)
        y_hi = (hi * c_hi).to(dt).to(tl.float32) + (lo * s_hi).to(dt).to(tl.float32)
    else:
        y_lo = lo * c_lo + (-hi) * s_lo
        y_hi = hi * c_hi + lo * s_hi
    return y_lo, y_hi


@triton.jit
def rms_norm(x_ptr, w_ptr, out_ptr, dim, heads, x_tok, x_head, out_stride, eps,
             MODE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row per program (row r: token r // heads, head r % heads, at their strides):
    h = x / rms(x) in float32; MODE 0 (Qwen) w * h rounded to the output dtype first,
    1 (Gemma) h * (1 + w), 2 (plain float scale) h * w."""
    inputs_ready(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    at = (row // heads) * x_tok + (row % heads) * x_head
    x = tl.load(x_ptr + at + cols, mask=ok, other=0.0).to(tl.float32)
    h = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _scaled(h, w, out_ptr.dtype.element_ty, MODE)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm(x_ptr, a_ptr, w_ptr, h_ptr, out_ptr, dim, x_stride, a_stride, h_stride,
                 out_stride, eps, MODE: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):
    """One row per program: h = x + a rounded to h's dtype (as torch's add), then
    :func:`rms_norm` of h into out."""
    inputs_ready(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * a_stride + cols, mask=ok, other=0.0).to(tl.float32)
    dt = h_ptr.dtype.element_ty
    h = (x + a).to(dt)
    tl.store(h_ptr + row * h_stride + cols, h, mask=ok)
    h = h.to(tl.float32)
    n = h * tl.math.rsqrt(tl.sum(h * h, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = _scaled(n, w, dt, MODE)
    tl.store(out_ptr + row * out_stride + cols, y.to(dt), mask=ok)


@triton.jit
def rotary_neox(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, heads, x_tok, x_head, out_tok,
                HALF: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr,
                PDL: tl.constexpr = False):
    """One (token, head) per program: out = x * cos + rot(x) * sin at the token's position,
    rot(x) = (-x[half:], x[:half]). With ROUND, cos/sin are first rounded to x's dtype and
    each product and the sum rounded to it, as torch's elementwise ops on that dtype do."""
    inputs_ready(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    src = x_ptr + t * x_tok + h * x_head
    lo = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y_lo, y_hi = _rotated(lo, hi, cos_ptr, sin_ptr, pos, i, ok, dt, HALF, ROUND)
    dst = out_ptr + t * out_tok + h * 2 * HALF
    tl.store(dst + i, y_lo.to(dt), mask=ok)
    tl.store(dst + HALF + i, y_hi.to(dt), mask=ok)


@triton.jit
def norm_rotary(x_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_ptr, n_q, x_tok,
                q_tok, k_tok, eps, MODE: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                ROUND: tl.constexpr, PDL: tl.constexpr = False):
    """One (token, head) per program over q's heads then k's (a row of x holds them in that
    order, HALF * 2 values a head): :func:`rms_norm` of the head with q_norm's or k_norm's
    weight, rounded to the output dtype as it stores, then :func:`rotary_neox` on that."""
    inputs_ready(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    is_q = (i * 0 + h) < n_q  # (BLOCK,), as a mask must be
    src = x_ptr + t * x_tok + h.to(tl.int64) * 2 * HALF
    lo = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + i, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
    w_lo = (tl.load(qw_ptr + i, mask=ok & is_q, other=0.0).to(tl.float32)
            + tl.load(kw_ptr + i, mask=ok & (~is_q), other=0.0).to(tl.float32))
    w_hi = (tl.load(qw_ptr + HALF + i, mask=ok & is_q, other=0.0).to(tl.float32)
            + tl.load(kw_ptr + HALF + i, mask=ok & (~is_q), other=0.0).to(tl.float32))
    dt = q_ptr.dtype.element_ty
    lo, hi = _scaled(lo * r, w_lo, dt, MODE), _scaled(hi * r, w_hi, dt, MODE)
    lo, hi = lo.to(dt).to(tl.float32), hi.to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    y_lo, y_hi = _rotated(lo, hi, cos_ptr, sin_ptr, pos, i, ok, dt, HALF, ROUND)
    q_dst = q_ptr + t * q_tok + h.to(tl.int64) * 2 * HALF
    k_dst = k_ptr + t * k_tok + (h - n_q).to(tl.int64) * 2 * HALF
    tl.store(q_dst + i, y_lo.to(dt), mask=ok & is_q)
    tl.store(q_dst + HALF + i, y_hi.to(dt), mask=ok & is_q)
    tl.store(k_dst + i, y_lo.to(dt), mask=ok & (~is_q))
    tl.store(k_dst + HALF + i, y_hi.to(dt), mask=ok & (~is_q))


@triton.jit
def _top_k(logit, ok, i, ids_ptr, w_ptr, t, K: tl.constexpr, KB: tl.constexpr,
           BLOCK: tl.constexpr, NORM: tl.constexpr):
    """Softmax over a token's logits (float32, -inf where not ``ok``), the K largest (the lower
    id first on a tie), renormalised to sum 1 when NORM, stored at row t of ids and w."""
    e = tl.exp(logit - tl.max(logit, axis=0))
    e = tl.where(ok, e, 0.0)
    p = e / tl.sum(e, axis=0)
    p = tl.where(ok, p, -1.0)
    slot = tl.arange(0, KB)
    vals = tl.zeros([KB], dtype=tl.float32)
    ids = tl.zeros([KB], dtype=tl.int64)
    for k in tl.static_range(K):
        best = tl.max(p, axis=0)
        at = tl.min(tl.where(p == best, i, BLOCK), axis=0)
        vals = tl.where(slot == k, best, vals)
        ids = tl.where(slot == k, at.to(tl.int64), ids)
        p = tl.where(i == at, -1.0, p)
    if NORM:
        vals = vals / tl.sum(vals, axis=0)
    tl.store(ids_ptr + t * K + slot, ids, mask=slot < K)
    tl.store(w_ptr + t * K + slot, vals.to(w_ptr.dtype.element_ty), mask=slot < K)


@triton.jit
def route_topk(logits_ptr, ids_ptr, w_ptr, E, stride, K: tl.constexpr, KB: tl.constexpr,
               BLOCK: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """One token per program: softmax over its E router logits in float32, the K largest
    (the lower id first on a tie), renormalised to sum 1 when NORM."""
    inputs_ready(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < E
    logit = tl.load(logits_ptr + t * stride + i, mask=ok, other=float("-inf")).to(tl.float32)
    _top_k(logit, ok, i, ids_ptr, w_ptr, t, K, KB, BLOCK, NORM)


@triton.jit
def route_hidden(x_ptr, g_ptr, logits_ptr, count_ptr, ids_ptr, w_ptr, H, E, x_stride,
                 K: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_H: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False):
    """Token t (axis 0), router rows ROWS * axis 1 on: those rows' logits (``x @ g^T``, summed
    in float32, rounded to x's dtype as the matmul stores them) into float32 ``logits``
    (T, E); the program that completes the token's logits (``count`` per token, which it sets
    back to 0 for the next launch) takes the token's top K from them as :func:`route_topk`."""
    inputs_ready(PDL)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < E
    cols = tl.arange(0, BLOCK_H)
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        c = h0 + cols
        ok = c < H
        x = tl.load(x_ptr + t * x_stride + c, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None].to(tl.int64) * H + c[None, :],
                    mask=row_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
        acc += g * x[None, :]
    logit = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + rows, logit, mask=row_ok)
    # the stores above are seen by whichever program counts last (release, then acquire)
    done = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        i = tl.arange(0, BLOCK)
        ok = i < E
        every = tl.load(logits_ptr + t * E + i, mask=ok, other=float("-inf"),
                        cache_modifier=".cg")  # from L2: other programs wrote them
        _top_k(every, ok, i, ids_ptr, w_ptr, t, K, KB, BLOCK, NORM)
        tl.store(count_ptr + t, 0)
