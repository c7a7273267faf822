"""Q8_0 regrouped for wide GPU loads: eight Q8_0 blocks (256 weights) as one block, their
eight f16 scales first, then their 256 int8 values.

Block (272 bytes): ``d: f16[8] | qs: int8[256]``; weight ``32 k + i`` = ``d[k] * qs[32 k + i]``.
The same scales and values as Q8_0, so the same weights and the same products; only the bytes
move. In a row of whole blocks starting 16-byte aligned, every block's scales and values start
16-byte aligned, so a GPU reads them 16 bytes a load, where GGUF's 34-byte blocks leave Q8_0's
values 2-byte aligned (``kernels/triton_gemv.py``). Not a GGUF type: resident experts are
regrouped on the GPU after loading (:func:`regroup`), the file keeps Q8_0.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor
from freetoken.quant.blocks import BlockFormat, f16_field
from freetoken.quant.q8_0 import Q8_0

GROUP = 8  # Q8_0 blocks per block


class Q8_0x8(BlockFormat):
    name = "q8_0x8"
    block_size = 32 * GROUP
    block_bytes = 34 * GROUP
    gguf_type: int | None = None

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        return self.dequantize_as(t, torch.float32)

    def dequantize_as(self, t: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
        """As ``dequantize(t).to(dtype)`` in one pass (q8_0's): no float32 tensor of the whole
        matrix (a dense layer's prefill dequantises it per call)."""
        b = self.blocks(t)
        d = torch.cat([f16_field(b, 2 * k) for k in range(GROUP)], dim=-1)[..., None]
        out = torch.empty(*b.shape[:-1], GROUP, 32, dtype=dtype, device=b.device)
        torch.mul(b[..., 2 * GROUP:].view(torch.int8).unflatten(-1, (GROUP, 32)), d, out=out)
        return out.reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        self.row_bytes(x.shape[-1])  # whole groups, or a clear error
        q = Q8_0().quantize(x)
        return QuantTensor(self.name, q.shape, regroup(q.data))


def regroups(cols: int) -> bool:
    """Whether Q8_0 rows of ``cols`` weights regroup (whole blocks of 256)."""
    return cols % (32 * GROUP) == 0


def regroup(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows ``(..., n * 34)`` uint8 as Q8_0x8 rows of the same size (a new tensor on the
    same device); ``n`` a multiple of 8."""
    blocks = data.reshape(*data.shape[:-1], -1, GROUP, 34)
    out = torch.cat([blocks[..., :2].flatten(-2), blocks[..., 2:].flatten(-2)], dim=-1)
    return out.reshape(data.shape)
