"""The one interface every checkpoint reader implements.

A reader opens a checkpoint without reading its weights, builds the :class:`ModelConfig`, and
yields each tensor under our name (Hugging Face checkpoint names, see ``names.py``) as a
:class:`QuantTensor` that views the bytes on disk without copying them, or, where only its
format, shape and size are wanted (planning), as a :class:`TensorInfo` from the header alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from freetoken.config import ModelConfig
from freetoken.quant import QuantTensor


@dataclass(frozen=True)
class TensorInfo:
    """What ``tensors()`` would yield for one tensor, without its data: our name, the format,
    the logical shape and ``QuantTensor.nbytes`` (the bytes as read, scales included)."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    nbytes: int


class Checkpoint(Protocol):
    path: Path
    config: ModelConfig
    chat_template: str | None
    generation_config: dict[str, Any]

    def tensor_names(self) -> list[str]:
        """Our names of every tensor, without reading any data."""
        ...

    def tensor_infos(self) -> Iterator[TensorInfo]:
        """What :meth:`tensors` yields, in its order, with no data read and nothing repacked."""
        ...

    def tensors(self) -> Iterator[tuple[str, QuantTensor]]:
        """Every tensor as (our name, zero-copy view). Views stay valid while the reader lives;
        a format whose stored blocks are not ours is repacked on each pass: for formats, shapes
        and sizes use :meth:`tensor_infos`."""
        ...

    def tokenizer(self) -> Any:
        """A ``transformers`` fast tokenizer for this checkpoint."""
        ...
