"""Causal self-attention over the paged KV cache, full or sliding-window, grouped-query."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.engine.context import ForwardContext


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots (B, S): (B, S, Hkv, D); index_select costs about half of advanced
    indexing per call on the CPU."""
    return torch.index_select(cache, 0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int,
    scale: float, window: int = 0,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> (T, Hq, D).

    The new keys are written to their slots first; then each sequence's queries (padded to
    (B, Tq)) attend over its keys (padded to (B, S)). Query at position p sees keys j <= p,
    and with a window W only p - j < W.
    """
    ctx.kv.store(layer, ctx.slots, k, v)
    keys = _gather(ctx.kv.k[layer], ctx.k_slots).transpose(1, 2)  # (B, Hkv, S, D)
    values = _gather(ctx.kv.v[layer], ctx.k_slots).transpose(1, 2)
    queries = q[ctx.q_index].transpose(1, 2)  # (B, Hq, Tq, D)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=ctx.masks[window], scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out = out.transpose(1, 2)  # (B, Tq, Hq, D)
    if ctx.decode:
        return out.squeeze(1)
    return out[0] if ctx.single else out[ctx.q_valid]
