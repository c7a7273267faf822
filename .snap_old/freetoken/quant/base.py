"""The interface every weight format implements, and the tensor type readers hand out.

A checkpoint reader never converts weights: it yields a :class:`QuantTensor` that holds a
zero-copy view of the bytes on disk plus the logical shape. A :class:`QuantFormat` knows how
many bytes a block takes and how to turn those bytes into float32 (the reference, slow twin of
every kernel that reads the format).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

import torch


@dataclass(frozen=True)
class QuantTensor:
    """One weight as stored in a checkpoint.

    ``data`` is the storage: for block formats a ``uint8`` tensor of shape
    ``(*shape[:-1], row_bytes)``; for plain float formats a tensor of that dtype and ``shape``.
    ``scales`` holds companion tensors of formats that keep them apart from the data (fp8_block:
    ``weight_scale_inv``; nvfp4: ``weight_scale``, ``weight_scale_2``).
    """

    fmt: str
    shape: tuple[int, ...]
    data: torch.Tensor
    scales: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + sum(
            s.numel() * s.element_size() for s in self.scales.values()
        )


class QuantFormat(Protocol):
    """A weight format: one module in ``freetoken/quant`` and one row in the registry."""

    name: str
    block_size: int  # elements per block along the last axis (1 for plain floats)
    block_bytes: int  # bytes per block in ``QuantTensor.data``
    gguf_type: int | None  # GGMLQuantizationType value, None for non-GGUF formats

    def row_bytes(self, cols: int) -> int:
        """Bytes one row of ``cols`` elements takes in ``QuantTensor.data``."""
        ...

    def dequantize(self, t: QuantTensor) -> torch.Tensor:
        """Reference dequantisation: float32 tensor of ``t.shape``. Never in place."""
        ...

    def quantize(self, x: torch.Tensor) -> QuantTensor:
        """Encode a float tensor (last axis a multiple of block_size) in this format."""
        ...


@cache
def value_table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A code -> value table (float32) on ``device``, made once per device: a dequantisation
    inside a CUDA graph capture must not copy a fresh table from the host."""
    return torch.tensor(values, dtype=torch.float32, device=device)
