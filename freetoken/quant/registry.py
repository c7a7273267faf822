"""The table of weight formats: one row per module, looked up by name or by GGUF type.

A GGUF type whose blocks are not our layout of a format is read by repacking into that format
(``GGUF_REPACKED``: GGUF NVFP4 into nvfp4); the ``gguf_*`` functions hide the difference from
the GGUF reader and writer.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from freetoken.quant import nvfp4_gguf
from freetoken.quant.base import QuantFormat, QuantTensor
from freetoken.quant.floats import BF16, F16, F32
from freetoken.quant.fp8_block import FP8Block
from freetoken.quant.mxfp4 import MXFP4
from freetoken.quant.nvfp4 import NVFP4
from freetoken.quant.q4_0 import Q4_0
from freetoken.quant.q4_k import Q4_K
from freetoken.quant.q5_0 import Q5_0
from freetoken.quant.q5_k import Q5_K
from freetoken.quant.q6_k import Q6_K
from freetoken.quant.q8_0 import Q8_0
from freetoken.quant.q8_0x8 import Q8_0x8

_ALL: tuple[QuantFormat, ...] = (
    F32,
    F16,
    BF16,
    Q8_0(),
    Q8_0x8(),
    Q4_0(),
    Q5_0(),
    Q4_K(),
    Q5_K(),
    Q6_K(),
    MXFP4(),
    FP8Block(),
    NVFP4(),
)

FORMATS: dict[str, QuantFormat] = {f.name: f for f in _ALL}
_BY_GGUF_TYPE: dict[int, QuantFormat] = {f.gguf_type: f for f in _ALL if f.gguf_type is not None}
GGUF_REPACKED = {"nvfp4": nvfp4_gguf}  # our format -> the module that reads its GGUF blocks
_BY_GGUF_TYPE |= {m.GGUF_TYPE: FORMATS[f] for f, m in GGUF_REPACKED.items()}


def get_format(name: str) -> QuantFormat:
    """The format registered as ``name``; ValueError listing the choices otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        choices = ", ".join(FORMATS)
        raise ValueError(f"unknown quant format {name!r} (choose from {choices})") from None


def dequantize_as(t: QuantTensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, the same values as ``dequantize(t).to(dtype)``; formats with a
    ``dequantize_as`` of their own do it without the float32 intermediate."""
    fmt = get_format(t.fmt)
    fused = getattr(fmt, "dequantize_as", None)
    if fused is not None:
        return fused(t, dtype)
    if t.data.dtype.is_floating_point and t.fmt in ("f32", "f16", "bf16"):
        return t.data.to(dtype)
    return fmt.dequantize(t).to(dtype)


def format_for_gguf_type(t: int) -> QuantFormat:
    """The format that reads GGUF tensors of GGML type ``t``; ValueError if we have none."""
    if t in _BY_GGUF_TYPE:
        return _BY_GGUF_TYPE[t]
    try:
        type_name = GGMLQuantizationType(t).name
    except ValueError:
        type_name = f"#{t} (not a GGML type)"
    supported = ", ".join(GGMLQuantizationType(k).name for k in _BY_GGUF_TYPE)
    raise ValueError(
        f"unsupported GGUF tensor type {type_name} (supported: {supported}); "
        "re-quantise the model to one of these"
    )


def gguf_type_of(name: str) -> int | None:
    """The GGML type a tensor of format ``name`` is written as, None if GGUF has none."""
    if name in GGUF_REPACKED:
        return GGUF_REPACKED[name].GGUF_TYPE
    return get_format(name).gguf_type


def gguf_block_size(name: str) -> int:
    """Elements per GGUF block of format ``name`` (a row is a whole number of them)."""
    if name in GGUF_REPACKED:
        return GGUF_REPACKED[name].BLOCK
    return get_format(name).block_size


def gguf_row_bytes(name: str, cols: int) -> int:
    """Bytes one row of ``cols`` elements of format ``name`` takes in a GGUF file."""
    if name in GGUF_REPACKED:
        return GGUF_REPACKED[name].row_bytes(cols)
    return get_format(name).row_bytes(cols)


def gguf_read(name: str, data: torch.Tensor, shape: tuple[int, ...]) -> QuantTensor:
    """A GGUF tensor's stored ``data`` as a tensor of format ``name``: the data itself, or
    repacked (never dequantised) where the layouts differ."""
    if name in GGUF_REPACKED:
        return GGUF_REPACKED[name].read(data, shape)
    return QuantTensor(name, shape, data)


def gguf_read_nbytes(name: str, shape: tuple[int, ...], stored: int) -> int:
    """``nbytes`` of :func:`gguf_read`'s tensor of ``shape`` whose file bytes are ``stored``,
    without reading them."""
    if name in GGUF_REPACKED:
        return GGUF_REPACKED[name].read_nbytes(shape)
    return stored


def gguf_write(qt: QuantTensor) -> torch.Tensor:
    """``qt`` as the uint8 rows a GGUF file stores (:func:`gguf_read`'s inverse)."""
    if qt.fmt in GGUF_REPACKED:
        return GGUF_REPACKED[qt.fmt].write(qt)
    return qt.data.contiguous().view(torch.uint8)


def gguf_quantize(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` in format ``name`` as the uint8 rows a GGUF file stores ``(..., gguf_row_bytes)``."""
    if name in GGUF_REPACKED:
        m = GGUF_REPACKED[name]
        return m.write(m.quantize(x))
    return get_format(name).quantize(x).data.contiguous().view(torch.uint8)
