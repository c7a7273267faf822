"""Hugging Face block-scaled fp8 (DeepSeek-V3 / Qwen3 FP8 checkpoints).

Data: float8_e4m3fn ``(..., rows, cols)``. ``scales["weight_scale_inv"]``: float32
``(..., ceil(rows / 128), ceil(cols / 128))``, one multiplier per 128 x 128 tile (edge tiles
are partial). Weight = ``float(w) * weight_scale_inv[r // 128, c // 128]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.quant.base import QuantTensor

TILE = 128
E4M3_MAX = 448.0


def expand_tiles(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Per-tile values ``(..., R, C)`` -> per-element ``(..., rows, cols)``."""
    return s.repeat_interleave(TILE, -2)[..., :rows, :].repeat_interleave(TILE, -1)[..., :cols]


class FP8Block:
    name = "fp8_block"
    block_size = 1
    block_bytes = 1
    gguf_type: int | None = None

    def row_bytes(self, cols: int) -> int:
        return cols

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        *lead, rows, cols = t.shape
        w = t.data.view(torch.float8_e4m3fn) if t.data.dtype == torch.uint8 else t.data
        s = t.scales["weight_scale_inv"]
        tiles = (*lead, -(-rows // TILE), -(-cols // TILE))
        if w.dtype != torch.float8_e4m3fn or tuple(w.shape) != t.shape or s.shape != tiles:
            raise ValueError(
                f"fp8_block: expected float8_e4m3fn {t.shape} with weight_scale_inv {tiles}, "
                f"got {w.dtype} {tuple(w.shape)} with {tuple(s.shape)}"
            )
        return w.float() * expand_tiles(s.float(), rows, cols)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        *lead, rows, cols = x.shape
        pad_r, pad_c = -rows % TILE, -cols % TILE
        tiles = F.pad(x.float().abs(), (0, pad_c, 0, pad_r))
        tiles = tiles.unflatten(-1, (-1, TILE)).unflatten(-3, (-1, TILE))  # (..., R, T, C, T)
        amax = tiles.amax(dim=(-3, -1))
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        w = (x.float() / expand_tiles(scale, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
        return QuantTensor(
            self.name,
            tuple(x.shape),
            w.to(torch.float8_e4m3fn),
            {"weight_scale_inv": scale},
        )
