"""Decode attention as one GPU kernel (Triton): the new key and value stored in their slots,
then keys and values read where they are in the paged KV cache, over each sequence's own
length.

The torch path (``layers/attention.py``) gathers every sequence's keys and values into a
padded (B, S) batch, S the longest sequence (in a decode graph: the whole context), then runs
SDPA with a mask: two stores, two copies and a masked kernel over the padding at every
layer. Here one
program per (sequence, KV head) walks that sequence's slots up to its position (from
``pos - window + 1`` with a window) with an online softmax, its query heads of the group
together. The torch path is its slow twin; the sums are in another order (and in bf16 the
probabilities are rounded before the product with the values), so the two agree to
rounding, not bit for bit.
"""

from __future__ import annotations

import os

import torch

from freetoken.kernels.build import KernelSwitch, overlap

BLOCK_S = 64  # keys per loop step
SWITCH = KernelSwitch("attention takes the torch path")


def _interpreted() -> bool:
    """Triton's interpreter (the CPU in tests) multiplies 16-bit blocks wrongly: float32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
           positions: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these: GPU queries (B, Hq, D) and new keys and
    values (B, Hkv, D) one per sequence, a cache (slots, Hkv, D) of the same
    shape and dtype, Hq a multiple of Hkv."""
    return (q.is_cuda and SWITCH.on and q.dim() == 3 and k_cache.dim() == 3
            and tuple(k.shape) == (q.shape[0], *k_cache.shape[1:])
            and q.shape[2] == k_cache.shape[2] and q.shape[1] % k_cache.shape[1] == 0
            and q.dtype == k.dtype == k_cache.dtype and positions.numel() == q.shape[0]
            and v.shape == k.shape and v.dtype == k.dtype and q.stride(2) == 1
            and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, k_slots: torch.Tensor,
                     positions: torch.Tensor, scale: float,
                     window: int = 0) -> torch.Tensor | None:
    """q (B, Hq, D) and the new k, v (B, Hkv, D), stored first at ``slots`` (B,) of the
    caches (slots, Hkv, D); k_slots (B, S) the slots of keys 0..S-1 in order, positions
    (B,) -> (B, Hq, D); None (nothing stored) when the kernel failed to build (logged
    once)."""
    import triton

    from freetoken.kernels import triton_attention

    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    group = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out

    def launch() -> None:
        triton_attention.decode_attention[(B, Hkv)](
            q, k_cache, v_cache, k_slots, positions, out, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_slots.stride(0), out.stride(0),
            out.stride(1), scale, window, k, v, slots, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), GROUP=group, GP=max(16, triton.next_power_of_2(group)),
            D=D, DP=max(16, triton.next_power_of_2(D)), BLOCK_S=BLOCK_S,
            MMA=q.dtype in (torch.bfloat16, torch.float16) and not _interpreted(), num_warps=4,
            **overlap(q.device))

    return out if SWITCH.launch(launch, "decode attention") else None
