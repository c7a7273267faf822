"""GGUF Q5_K: Q4_K's 256-weight super-blocks with a fifth bit per weight.

Block (176 bytes): ``d: f16 | dmin: f16 | scales: u8[12] | qh: u8[32] | qs: u8[128]``.
``d``, ``dmin``, ``scales`` and ``qs`` are laid out as in Q4_K (:mod:`.q4_k`); weight ``l`` of
sub-block ``j`` adds 16 when bit ``j`` of ``qh[l]`` is set, so its quant is 0..31.
Weight = ``d * sc[j] * q - dmin * m[j]``. Data: uint8 ``(..., rows, cols // 256 * 176)``.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import BlockFormat
from freetoken.quant.q4_k import fit_sub_blocks, low_quants, pack_low_quants, sub_blocks


class Q5_K(BlockFormat):
    name = "q5_k"
    block_size = 256
    block_bytes = 176
    gguf_type: int | None = 13

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        shifts = torch.arange(8, dtype=torch.uint8, device=b.device).unsqueeze(-1)
        high = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1  # (..., n, 8, 32): bit j of qh[l]
        q = low_quants(b[..., 48:]) + (high << 4)
        return sub_blocks(b, q).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x).unflatten(-1, (8, 32))  # (..., n, 8, 32)
        head, q = fit_sub_blocks(xb, 31)
        q = q.to(torch.uint8)
        shifts = torch.arange(8, dtype=torch.uint8, device=q.device).unsqueeze(-1)
        qh = ((q >> 4) << shifts).sum(-2, dtype=torch.uint8)  # bit j: sub-block j's fifth bit
        return self.pack(x, [*head, qh, pack_low_quants(q & 15)])
