"""The Triton kernel of :mod:`freetoken.kernels.paged_attention` (imported only when first
used: triton is needed on GPU machines, not on CPU installs)."""

from __future__ import annotations

import triton
import triton.language as tl

from freetoken.kernels.triton_overlap import inputs_ready


@triton.jit
def decode_attention(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, out_ptr, q_tok, q_head, kv_slot,
                     kv_head, slots_row, out_tok, out_head, scale, window, k_new_ptr, v_new_ptr,
                     new_slot_ptr, k_tok, k_head, v_tok, v_head,
                     GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                     DP: tl.constexpr, BLOCK_S: tl.constexpr, MMA: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Sequence b (axis 0), KV head h (axis 1): the new key and value of head h stored in
    their slot first, then its GROUP query heads against keys 0..pos of the sequence
    (pos - window < j with a window), read from their slots, online softmax in float32; the
    two products on the tensor cores in the cache's dtype with MMA (the probabilities rounded
    to it first, as flash attention does), else in float32."""
    inputs_ready(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    new = tl.load(new_slot_ptr + b).to(tl.int64) * kv_slot + h * kv_head + d
    tl.store(k_ptr + new, tl.load(k_new_ptr + b * k_tok + h * k_head + d, mask=d < D), mask=d < D)
    tl.store(v_ptr + new, tl.load(v_new_ptr + b * v_tok + h * v_head + d, mask=d < D), mask=d < D)
    tl.debug_barrier()  # the program's own stores, seen by all its threads below
    q_ok = (g < GROUP)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * q_tok + (h * GROUP + g)[:, None] * q_head + d[None, :], mask=q_ok,
                other=0.0)
    if not MMA:
        q = q.to(tl.float32)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    m = tl.full([GP], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, DP], dtype=tl.float32)
    for s0 in range((lo // BLOCK_S) * BLOCK_S, pos + 1, BLOCK_S):
        j = s0 + tl.arange(0, BLOCK_S)
        ok = (j >= lo) & (j <= pos)
        slot = tl.load(slots_ptr + b * slots_row + j, mask=ok, other=0).to(tl.int64)
        at = slot[:, None] * kv_slot + h * kv_head + d[None, :]
        kv_ok = ok[:, None] & (d < D)[None, :]
        keys = tl.load(k_ptr + at, mask=kv_ok, other=0.0)
        if MMA:
            s = tl.dot(q, tl.trans(keys))
        else:
            s = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # (GP, BLOCK_S)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        keep = tl.exp(m - m_new)
        total = total * keep + tl.sum(p, axis=1)
        values = tl.load(v_ptr + at, mask=kv_ok, other=0.0)
        if MMA:
            pv = tl.dot(p.to(values.dtype), values)
        else:
            pv = tl.dot(p, values.to(tl.float32), input_precision="ieee")
        acc = acc * keep[:, None] + pv
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + b * out_tok + (h * GROUP + g)[:, None] * out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_ok)
