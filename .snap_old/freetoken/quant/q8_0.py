"""GGUF Q8_0: 32 weights per block, one f16 scale, int8 values.

Block (34 bytes): ``d: f16 | qs: int8[32]``; weight ``i`` = ``d * qs[i]``.
Data: uint8 ``(..., rows, cols // 32 * 34)``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import BlockFormat, f16_bytes, f16_field, round_half_away, safe_inverse


class Q8_0(BlockFormat):
    name = "q8_0"
    block_size = 32
    block_bytes = 34
    gguf_type: int | None = 8

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        qs = b[..., 2:].view(torch.int8).float()
        return (qs * f16_field(b, 0)).reshape(t.shape)

    def dequantize_as(self, t: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
        """As ``dequantize(t).to(dtype)`` in one pass: the int8 x scale product is formed in
        float32 and rounded once to ``dtype`` as it is stored (no float32 tensor)."""
        b = self.blocks(t)
        out = torch.empty(*b.shape[:-1], 32, dtype=dtype, device=b.device)
        torch.mul(b[..., 2:].view(torch.int8), f16_field(b, 0), out=out)
        return out.reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x)
        d = xb.abs().amax(-1, keepdim=True) / 127
        qs = round_half_away(xb * safe_inverse(d)).to(torch.int8).view(torch.uint8)
        return self.pack(x, [f16_bytes(d), qs])
