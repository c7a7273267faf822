"""Weight formats: one module per format, one row per format in :mod:`.registry`."""

from freetoken.quant.base import QuantFormat, QuantTensor
from freetoken.quant.registry import FORMATS, dequantize_as, format_for_gguf_type, get_format

__all__ = ["FORMATS", "QuantFormat", "QuantTensor", "dequantize_as", "format_for_gguf_type",
           "get_format"]
