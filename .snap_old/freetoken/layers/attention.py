"""Causal self-attention over the paged KV cache, full or sliding-window, grouped-query."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from freetoken.cpu.library import optional
from freetoken.kernels import paged_attention as paged
from freetoken.layers.context import ForwardContext


def _gather(table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """table[slots] for slots (B, S): (B, S, Hkv, D); index_select costs about half of advanced
    indexing per call on the CPU."""
    return torch.index_select(table, 0, slots.reshape(-1)).view(*slots.shape, *table.shape[1:])


def _native_decode() -> Any:
    """The native library's decode attention, or None where the library is not built (the
    torch path below is its slow twin and runs instead)."""
    return optional("ft_attention_decode")


def _decode_on_cpu(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   ctx: ForwardContext, layer: int, scale: float, window: int) -> torch.Tensor:
    """One query per sequence (q (B, Hq, D)) in a single native call that also stores the new
    keys and values: on the CPU at batch 1 the torch path's dozen calls cost more in dispatch
    than in arithmetic."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, D = q.shape
    S = ctx.k_slots.shape[1]
    kc, vc = ctx.kv.k[layer], ctx.kv.v[layer]
    visible = ctx.masks[window].reshape(B, S).contiguous()
    new_slots, slots = ctx.slots.long().contiguous(), ctx.k_slots.long().contiguous()
    out = torch.empty_like(q)
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), new_slots.data_ptr(), kc.data_ptr(),
       vc.data_ptr(), slots.data_ptr(), visible.data_ptr(), B, S, Hq, kc.shape[1], D, scale,
       out.data_ptr())
    return out


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int,
    scale: float, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> (T, Hq, D).

    The new keys are written to their slots first; then each sequence's queries (padded to
    (B, Tq)) attend over its keys (padded to (B, S)). Query at position p sees keys j <= p,
    and with a window W only p - j < W. ``sinks`` (Hq,): one more logit per head in every
    softmax, with no value (GPT-OSS); it is an extra key of zeros whose mask entry is the
    sink. A layer whose (Hkv, D) is narrower than the pool's row uses the row's front.
    """
    pool = tuple(ctx.kv.k.shape[2:])
    if sinks is None and tuple(k.shape[1:]) == pool and ctx.decode and q.device.type == "cpu" \
            and q.dtype == ctx.kv.k.dtype == torch.float32 \
            and k.dtype == v.dtype == torch.float32 and ctx.kv.k.is_contiguous() \
            and ctx.kv.v.is_contiguous():
        fn = _native_decode()
        if fn is not None:
            return _decode_on_cpu(fn, q, k, v, ctx, layer, scale, window)
    Hkv, D = k.shape[1:]
    if ctx.decode and sinks is None and (Hkv, D) == pool \
            and paged.usable(q, k, v, ctx.kv.k[layer], ctx.positions):  # one GPU kernel, stores too
        out = paged.decode_attention(q, k, v, ctx.slots, ctx.kv.k[layer], ctx.kv.v[layer],
                                     ctx.k_slots, ctx.positions, scale, window)
        if out is not None:
            return out
    if (Hkv, D) != pool:
        ctx.kv.store(layer, ctx.slots, _to_row(k, pool), _to_row(v, pool))
    else:
        ctx.kv.store(layer, ctx.slots, k, v)
    if not ctx.decode and not ctx.single and q.device.type == "cpu" and ctx.spans:
        return torch.cat([_one_sequence(q, ctx, layer, scale, window, sinks, b, Hkv, D)
                          for b in range(len(ctx.spans))])
    keys = _from_row(_gather(ctx.kv.k[layer], ctx.k_slots), Hkv, D).transpose(1, 2)
    values = _from_row(_gather(ctx.kv.v[layer], ctx.k_slots), Hkv, D).transpose(1, 2)
    queries = q[ctx.q_index].transpose(1, 2)  # (B, Hq, Tq, D)
    mask = ctx.masks[window]
    if sinks is not None:
        keys, values, mask = _with_sinks(keys, values, mask, sinks, q.shape[1])
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out = out.transpose(1, 2)  # (B, Tq, Hq, D)
    if ctx.decode:
        return out.squeeze(1)
    return out[0] if ctx.single else out[ctx.q_valid]


def _one_sequence(q: torch.Tensor, ctx: ForwardContext, layer: int, scale: float, window: int,
                  sinks: torch.Tensor | None, b: int, Hkv: int, D: int) -> torch.Tensor:
    """Sequence b of a prefill batch alone, with the shapes and operations it would have in a
    batch of its own: on the CPU a padded batch rounds differently (by ~3e-5 on Gemma-3), and
    int8-rounded activations downstream can turn that into another greedy token, so a request
    would answer differently with company than alone. Returns its (count, Hq, D) rows."""
    first, count, end = ctx.spans[b]
    k_slots = ctx.k_slots[b:b + 1, :end]
    keys = _from_row(_gather(ctx.kv.k[layer], k_slots), Hkv, D).transpose(1, 2)
    values = _from_row(_gather(ctx.kv.v[layer], k_slots), Hkv, D).transpose(1, 2)
    rows = torch.arange(first, first + count, device=q.device).unsqueeze(0)
    queries = q[rows].transpose(1, 2)  # (1, Hq, count, D)
    mask = ctx.masks[window][b:b + 1, :, :count, :end].contiguous()
    if sinks is not None:
        keys, values, mask = _with_sinks(keys, values, mask, sinks, q.shape[1])
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != Hkv,
    )
    return out.transpose(1, 2)[0]


def _to_row(x: torch.Tensor, pool: tuple[int, ...]) -> torch.Tensor:
    """(T, Hkv, D) zero-padded into the pool's (T, *pool) row."""
    flat = x.reshape(x.shape[0], -1)
    return F.pad(flat, (0, pool[0] * pool[1] - flat.shape[1])).view(x.shape[0], *pool)


def _from_row(rows: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """(B, S, *pool) -> (B, S, heads, dim) from the front of each row (a view)."""
    if tuple(rows.shape[2:]) == (heads, dim):
        return rows
    return rows.flatten(2)[..., : heads * dim].unflatten(-1, (heads, dim))


def _with_sinks(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                sinks: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """One zero key and value appended per sequence, seen by every query with score sink[h]."""
    B, _, Tq, S = mask.shape
    pad = keys.new_zeros(*keys.shape[:2], 1, keys.shape[3])
    keys, values = torch.cat([keys, pad], 2), torch.cat([values, pad], 2)
    scores = torch.zeros(B, heads, Tq, S + 1, dtype=keys.dtype, device=keys.device)
    scores[..., :S].masked_fill_(~mask, float("-inf"))
    scores[..., S] = sinks.to(keys.dtype).view(1, heads, 1)
    return keys, values, scores
