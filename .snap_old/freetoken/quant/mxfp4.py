"""GGUF MXFP4 (OCP microscaling): 32 e2m1 weights per block sharing one e8m0 exponent.

Block (17 bytes): ``e: u8 | qs: u8[16]``; low nibbles hold weights 0..15, high nibbles 16..31.
A nibble is an e2m1 code (sign bit 3); weight = ``2**(e - 127) * e2m1``, computed as in ggml
as ``2**(e - 128) * (2 * e2m1)`` so every value stays an exact float32.
Data: uint8 ``(..., rows, cols // 32 * 17)``.

GPT-OSS's Hugging Face checkpoints keep the same codes and exponents apart (``*_blocks``:
uint8 ``(..., rows, cols // 32, 16)``, byte ``j`` holding weights ``2j`` (low nibble) and
``2j + 1`` (high); ``*_scales``: the e8m0 bytes ``(..., rows, cols // 32)``);
:func:`from_split_blocks` reorders them into our blocks without computing a value.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor, value_table
from freetoken.quant.blocks import BlockFormat, nibbles, pack_nibbles

# e2m1 code -> twice its value
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """``2**(e - 128)`` as float32, exact for every byte (0 and 1 give subnormals)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def from_split_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    """A ``*_blocks`` / ``*_scales`` pair (module doc) as one mxfp4 tensor of shape
    ``(..., rows, cols)``: each block's exponent byte, then its 32 codes repacked in our order."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 \
            or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: expected uint8 blocks (..., G, 16) and uint8 scales (..., G), got "
            f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # (..., G, 32)
    data = torch.cat([scales.unsqueeze(-1), pack_nibbles(codes)], dim=-1)
    *lead, groups = scales.shape
    return QuantTensor("mxfp4", (*lead, groups * 32), data.reshape(*lead, groups * 17))


class MXFP4(BlockFormat):
    name = "mxfp4"
    block_size = 32
    block_bytes = 17
    gguf_type: int | None = 39

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        values = value_table(E2M1_DOUBLED, b.device)[nibbles(b[..., 1:]).long()]
        return (e8m0_half(b[..., :1]) * values).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x)
        amax = xb.abs().amax(-1, keepdim=True)
        # Largest e2m1 magnitude is 6 = 1.5 * 2**2, hence the -2.
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, 0)
        e = exp.clamp(0, 254).to(torch.uint8)
        table = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=x.device)
        grid = e8m0_half(e).unsqueeze(-1) * table
        codes = (grid - xb.unsqueeze(-1)).abs().argmin(-1)  # first of ties, like numpy
        return self.pack(x, [e, pack_nibbles(codes)])
