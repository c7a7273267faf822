"""Plain float formats: f32, f16, bf16.

Data: a tensor of the format's dtype and the logical shape, or its raw little-endian bytes as
uint8 ``(..., cols * itemsize)`` (GGUF readers may hand out bf16 that way).
"""

from __future__ import annotations

import torch

from freetoken.quant.base import QuantTensor


class FloatFormat:
    """An unquantised float dtype; ``block_size`` is 1 and a block is one element."""

    block_size = 1

    def __init__(self, name: str, dtype: torch.dtype, gguf_type: int) -> None:
        self.name = name
        self.dtype = dtype
        self.gguf_type: int | None = gguf_type
        self.block_bytes = dtype.itemsize

    def row_bytes(self, cols: int) -> int:
        return cols * self.block_bytes

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        data = t.data
        if data.dtype == torch.uint8:
            data = data.contiguous().view(self.dtype)
        if data.dtype != self.dtype or tuple(data.shape) != t.shape:
            raise ValueError(
                f"{self.name}: expected {self.dtype} data of shape {t.shape} (or its bytes), "
                f"got {t.data.dtype} {tuple(t.data.shape)}"
            )
        return data.to(torch.float32, copy=True)

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        data = to_bf16(x) if self.dtype == torch.bfloat16 else x.to(self.dtype, copy=True)
        return QuantTensor(self.name, tuple(x.shape), data)


def to_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 as ggml does: nearest-even on the bit pattern, NaNs forced quiet."""
    n = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(is_nan, (n & 0xFFFF0000) | (64 << 16), n)
    top = (n + 0x7FFF + ((n >> 16) & 1)) >> 16
    return top.to(torch.int32).to(torch.int16).view(torch.bfloat16)


F32 = FloatFormat("f32", torch.float32, 0)
F16 = FloatFormat("f16", torch.float16, 1)
BF16 = FloatFormat("bf16", torch.bfloat16, 30)
