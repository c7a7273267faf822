"""Weight formats: one module per format, one row per format in :mod:`.registry`."""

from freetoken.quant.base import QuantFormat, QuantTensor
from freetoken.quant.registry import (
    FORMATS,
    dequantize_as,
    format_for_gguf_type,
    get_format,
    gguf_block_size,
    gguf_quantize,
    gguf_read,
    gguf_read_nbytes,
    gguf_row_bytes,
    gguf_type_of,
    gguf_write,
)

__all__ = ["FORMATS", "QuantFormat", "QuantTensor", "dequantize_as", "format_for_gguf_type",
           "get_format", "gguf_block_size", "gguf_quantize", "gguf_read", "gguf_read_nbytes",
           "gguf_row_bytes", "gguf_type_of", "gguf_write"]
