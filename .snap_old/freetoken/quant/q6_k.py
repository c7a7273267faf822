"""GGUF Q6_K: 256-weight super-blocks of 16 sub-blocks x 16, int8 sub-scales, 6-bit values.

Block (210 bytes): ``ql: u8[128] | qh: u8[64] | scales: i8[16] | d: f16``.
Each half ``h`` of 128 weights uses ``ql[64h:64h+64]`` and ``qh[32h:32h+32]``; within a half,
weight ``l + 32s`` (``s`` = 0..3, ``l`` = 0..31) takes its low 4 bits from byte ``l + 32(s & 1)``
of ``ql`` (low nibble for s < 2, high nibble otherwise) and its top 2 bits from bits
``2s, 2s+1`` of ``qh[l]``. Weight ``i`` = ``d * scales[i // 16] * (q[i] - 32)``.
Data: uint8 ``(..., rows, cols // 256 * 210)``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import (
    BlockFormat,
    f16_bytes,
    f16_ceil,
    f16_field,
    nibbles,
    pack_nibbles,
    round_half_away,
    safe_inverse,
)


class Q6_K(BlockFormat):
    name = "q6_k"
    block_size = 256
    block_bytes = 210
    gguf_type: int | None = 14

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        low = nibbles(b[..., :128].unflatten(-1, (2, 64)))  # (..., n, 2, 128)
        qh = b[..., 128:192].unflatten(-1, (2, 32))
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
        q = ((low | (high << 4)).float() - 32).reshape(*b.shape[:-1], 16, 16)
        scale = (f16_field(b, 208) * b[..., 192:208].view(torch.int8).float()).unsqueeze(-1)
        return (scale * q).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        # Each sub-block's signed peak maps to -32; sub-scales share one f16 super-scale.
        xb = self.split(x).unflatten(-1, (16, 16))  # (..., n, 16, 16)
        sub = xb.gather(-1, xb.abs().argmax(-1, keepdim=True)).squeeze(-1) / -32
        d = sub.abs().amax(-1, keepdim=True) / 127
        d16 = f16_ceil(d)
        sc = torch.copysign(torch.ceil(sub.abs() * safe_inverse(d16)), sub).clamp(-127, 127)
        step = (d16 * sc).unsqueeze(-1)
        q = round_half_away(xb * safe_inverse(step)).clamp(-32, 31) + 32
        q = q.to(torch.uint8).flatten(-2).unflatten(-1, (2, 128))  # (..., n, 2, 128)
        ql = pack_nibbles(q & 15).flatten(-2)
        hi = (q >> 4).unflatten(-1, (4, 32))
        qh = hi[..., 0, :] | hi[..., 1, :] << 2 | hi[..., 2, :] << 4 | hi[..., 3, :] << 6
        scales = sc.to(torch.int8).view(torch.uint8)
        return self.pack(x, [ql, qh.flatten(-2), scales, f16_bytes(d16)])
