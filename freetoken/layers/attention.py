"""Causal self-attention over the KV cache, full or sliding-window, grouped-query."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.engine.context import ForwardContext


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, layer: int,
    scale: float, window: int = 0,
) -> torch.Tensor:
    """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens -> (T, Hq, D).

    Query at position p sees keys at positions j <= p, and with a window W only p - j < W.
    """
    k_all, v_all = ctx.kv.store(layer, ctx.positions, k, v, ctx.end)
    first = max(0, ctx.start - window + 1) if window else 0
    k_all, v_all = k_all[first:], v_all[first:]
    T = q.shape[0]
    mask = None
    if T > 1:  # one query sees every key in [first, end)
        q_pos = ctx.positions[:, None]
        k_pos = torch.arange(first, ctx.end, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window:
            mask &= q_pos - k_pos < window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k_all.transpose(0, 1).unsqueeze(0),
        v_all.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)
