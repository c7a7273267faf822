"""GGUF Q4_0: 32 weights per block, one f16 scale, 4-bit values offset by 8.

Block (18 bytes): ``d: f16 | qs: u8[16]``; low nibbles hold weights 0..15, high nibbles 16..31;
weight ``i`` = ``d * (q[i] - 8)``. Data: uint8 ``(..., rows, cols // 32 * 18)``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import (
    BlockFormat,
    f16_bytes,
    f16_field,
    nibbles,
    pack_nibbles,
    safe_inverse,
)


class Q4_0(BlockFormat):
    name = "q4_0"
    block_size = 32
    block_bytes = 18
    gguf_type: int | None = 2

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        q = nibbles(b[..., 2:]).float() - 8
        return (f16_field(b, 0) * q).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x)
        # The signed value of largest magnitude maps to -8, so the grid reaches it exactly.
        peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
        d = peak / -8
        q = torch.trunc(xb * safe_inverse(d) + 8.5).clamp(0, 15)
        return self.pack(x, [f16_bytes(d), pack_nibbles(q)])
