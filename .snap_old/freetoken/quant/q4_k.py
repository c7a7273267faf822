"""GGUF Q4_K: 256-weight super-blocks of 8 sub-blocks x 32, 6-bit sub-scales and sub-mins.

Block (144 bytes): ``d: f16 | dmin: f16 | scales: u8[12] | qs: u8[128]``.
``scales`` packs 8 six-bit scales ``sc`` and 8 six-bit mins ``m`` as three 4-byte rows
``a, b, c``: ``sc[0:4] = a & 63``, ``m[0:4] = b & 63``,
``sc[4:8] = (c & 15) | (a >> 6) << 4``, ``m[4:8] = (c >> 4) | (b >> 6) << 4``.
``qs`` is 4 chunks of 32 bytes; chunk ``k`` holds sub-block ``2k`` in its low nibbles and
``2k + 1`` in its high nibbles. Weight = ``d * sc[j] * q - dmin * m[j]`` (sub-block ``j``).
Data: uint8 ``(..., rows, cols // 256 * 144)``.
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


class Q4_K(BlockFormat):
    name = "q4_k"
    block_size = 256
    block_bytes = 144
    gguf_type: int | None = 12

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        b = self.blocks(t)
        return sub_blocks(b, low_quants(b[..., 16:])).reshape(t.shape)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        xb = self.split(x).unflatten(-1, (8, 32))  # (..., n, 8, 32)
        head, q = fit_sub_blocks(xb, 15)
        return self.pack(x, [*head, pack_low_quants(q)])


def low_quants(qs: torch.Tensor) -> torch.Tensor:
    """``qs`` (..., 128) -> the 4-bit quants of the 8 sub-blocks (..., 8, 32): chunk ``k`` of 32
    bytes holds sub-block ``2k`` in its low nibbles and ``2k + 1`` in its high nibbles."""
    return nibbles(qs.unflatten(-1, (4, 32))).unflatten(-1, (2, 32)).flatten(-3, -2)


def pack_low_quants(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`low_quants` for quants < 16 (..., 8, 32) -> (..., 128)."""
    return pack_nibbles(q.flatten(-2).unflatten(-1, (4, 64))).flatten(-2)


def sub_blocks(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The weights of super-blocks ``b`` (``d | dmin | scales`` first) with quants ``q`` (...,
    8, 32): ``d * sc[j] * q - dmin * m[j]``, float32 (..., 8, 32)."""
    a, bb, c = b[..., 4:16].unflatten(-1, (3, 4)).unbind(-2)
    sc = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1).float()
    m = torch.cat([bb & 63, (c >> 4) | ((bb >> 6) << 4)], dim=-1).float()
    scale = (f16_field(b, 0) * sc).unsqueeze(-1)  # (..., n, 8, 1)
    offset = (f16_field(b, 2) * m).unsqueeze(-1)
    return scale * q.float() - offset


def fit_sub_blocks(xb: torch.Tensor, levels: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Super-blocks ``xb`` (..., n, 8, 32) -> their head bytes (``d``, ``dmin`` and the 12
    bytes of six-bit scales and mins) and quants in ``0..levels``. A plain min/max fit per
    sub-block, not llama.cpp's iterative search."""
    neg_min = (-xb.amin(-1)).clamp(min=0)
    scale = (xb.amax(-1) + neg_min) / levels
    d = scale.amax(-1, keepdim=True) / 63
    dmin = neg_min.amax(-1, keepdim=True) / 63
    d16, dmin16 = f16_ceil(d), f16_ceil(dmin)
    # Rounding sub-scales up keeps every sub-block's range inside its levels.
    sc = torch.ceil(scale * safe_inverse(d16)).clamp(0, 63)
    m = torch.ceil(neg_min * safe_inverse(dmin16)).clamp(0, 63)
    step = (d16 * sc).unsqueeze(-1)
    q = round_half_away((xb + (dmin16 * m).unsqueeze(-1)) * safe_inverse(step)).clamp(0, levels)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    scales = [
        sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
        m[..., :4] | ((m[..., 4:] >> 4) << 6),
        (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
    ]
    return [f16_bytes(d16), f16_bytes(dmin16), *scales], q
