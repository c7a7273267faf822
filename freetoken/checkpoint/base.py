"""The one interface every checkpoint reader implements.

A reader opens a checkpoint without reading its weights, builds the :class:`ModelConfig`, and
yields each tensor under our name (Hugging Face checkpoint names, see ``names.py``) as a
:class:`QuantTensor` that views the bytes on disk without copying them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from freetoken.config import ModelConfig
from freetoken.quant import QuantTensor


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig
    chat_template: str | None
    generation_config: dict[str, Any]

    def tensor_names(self) -> list[str]:
        """Our names of every tensor, without reading any data."""
        ...

    def tensors(self) -> Iterator[tuple[str, QuantTensor]]:
        """Every tensor as (our name, zero-copy view). Views stay valid while the reader lives."""
        ...

    def tokenizer(self) -> Any:
        """A ``transformers`` fast tokenizer for this checkpoint."""
        ...
