"""GGUF Q5_0: 32 weights per block, one f16 scale, 5-bit values offset by 16.

Block (22 bytes): ``d: f16 | qh: u8[4] | qs: u8[16]``. Bit ``i`` of ``qh`` (little-endian u32)
is bit 4 of weight ``i``; low nibbles of ``qs`` hold weights 0..15, high nibbles 16..31;
weight ``i`` = ``d * (q[i] - 16)``. Data: uint8 ``(..., rows, cols // 32 * 22)``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import (
    BlockFormat,
    bits,
    f16_bytes,
    f16_field,
    nibbles,
    pack_bits,
    pack_nibbles,
    safe_inverse,
)


class Q5_0(BlockFormat):
    name = "q5_0"
    block_size = 32
    block_bytes = 22
    gguf_type: int | None = 6

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        q = (nibbles(b[..., 6:]) | (bits(b[..., 2:6]) << 4)).float() - 16
        return (f16_field(b, 0) * q).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x)
        peak = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
        d = peak / -16
        q = torch.trunc(xb * safe_inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
        return self.pack(x, [f16_bytes(d), pack_bits(q >> 4), pack_nibbles(q & 0x0F)])
