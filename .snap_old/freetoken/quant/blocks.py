"""Byte helpers shared by the GGUF block formats.

A block format stores each row as ``cols // block_size`` blocks of ``block_bytes`` bytes.
Dequantisation views ``QuantTensor.data`` as ``(..., n_blocks, block_bytes)``, decodes every
block at once and flattens back to the logical shape; quantisation runs the same in reverse.
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor


class BlockFormat:
    """Shared plumbing of the GGUF block formats: row sizing and the block view."""

    name: str
    block_size: int
    block_bytes: int
    gguf_type: int | None

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_size:
            raise ValueError(
                f"{self.name}: a row of {cols} elements is not a multiple of the block size "
                f"{self.block_size}"
            )
        return cols // self.block_size * self.block_bytes

    def blocks(self, t: QuantTensor) -> torch.Tensor:
        """``t.data`` as uint8 ``(..., n_blocks, block_bytes)``, after checking its shape."""
        *lead, cols = t.shape
        want = (*lead, self.row_bytes(cols))
        if t.data.dtype != torch.uint8 or tuple(t.data.shape) != want:
            raise ValueError(
                f"{self.name}: expected uint8 data of shape {want} for logical shape {t.shape}, "
                f"got {t.data.dtype} {tuple(t.data.shape)}"
            )
        return t.data.reshape(*lead, cols // self.block_size, self.block_bytes)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """A float tensor as float32 ``(..., n_blocks, block_size)``, after checking its width."""
        self.row_bytes(x.shape[-1])
        return x.float().reshape(*x.shape[:-1], -1, self.block_size)

    def pack(self, x: torch.Tensor, fields: list[torch.Tensor]) -> QuantTensor:
        """Concatenate per-block uint8 ``fields`` into the QuantTensor that encodes ``x``."""
        data = torch.cat(fields, dim=-1).reshape(*x.shape[:-1], -1)
        return QuantTensor(self.name, tuple(x.shape), data.contiguous())


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian f16 at byte ``start`` of every block, as float32 ``(..., n, 1)``."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """float32 ``(..., n, 1)`` rounded to f16, as its two little-endian bytes ``(..., n, 2)``."""
    return d.to(torch.float16).contiguous().view(torch.uint8)


def f16_ceil(d: torch.Tensor) -> torch.Tensor:
    """The smallest f16 >= ``d`` (``d >= 0``), as float32: a super-scale that never clips."""
    h = d.half()
    up = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where(h.float() < d, up, h).float()


def nibbles(b: torch.Tensor) -> torch.Tensor:
    """Bytes ``(..., k)`` -> ``(..., 2k)``: all low nibbles first, then all high nibbles."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nibbles`: values < 16 ``(..., 2k)`` -> bytes ``(..., k)``."""
    lo, hi = q.to(torch.uint8).chunk(2, dim=-1)
    return lo | (hi << 4)


def bits(b: torch.Tensor) -> torch.Tensor:
    """Bytes ``(..., k)`` -> their bits ``(..., 8k)``, least significant bit of byte 0 first."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def pack_bits(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bits`: 0/1 values ``(..., 8k)`` -> bytes ``(..., k)``."""
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    grouped = q.to(torch.int32).reshape(*q.shape[:-1], -1, 8)
    return (grouped * weights).sum(-1).to(torch.uint8)


def safe_inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d`` with 0 where ``d`` is 0, as ggml's reference quantisers do."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round to nearest, ties away from zero (torch.round ties to even)."""
    a = x.abs()
    whole = a.floor()
    return torch.copysign(whole + (a - whole >= 0.5).to(x.dtype), x)
