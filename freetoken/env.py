"""Every FREETOKEN_* environment variable, typed, in one place. Nothing else reads os.environ."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FREETOKEN_CACHE_DIR: converted tokenizers, the bandwidth profile; ~/.cache/freetoken."""
    return Path(os.environ.get("FREETOKEN_CACHE_DIR") or Path.home() / ".cache" / "freetoken")


def log_level() -> str:
    """FREETOKEN_LOG_LEVEL: debug, info (default), warning, error."""
    return os.environ.get("FREETOKEN_LOG_LEVEL", "info").upper()
