"""Weight formats: one module per format, one row per format in :mod:`.registry`."""

from freetoken.quant.base import QuantFormat, QuantTensor
from freetoken.quant.registry import FORMATS, format_for_gguf_type, get_format

__all__ = ["FORMATS", "QuantFormat", "QuantTensor", "format_for_gguf_type", "get_format"]
