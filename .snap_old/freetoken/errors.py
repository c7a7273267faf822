"""Errors a user can act on. Each message names what was wrong and what to do."""


class FreeTokenError(Exception):
    """Base of every error the CLI prints as one line (no traceback) before exiting non-zero."""


class CheckpointError(FreeTokenError):
    """A checkpoint is missing, corrupt, truncated or uses something we do not support."""


class ConfigError(FreeTokenError):
    """Flags or settings that contradict each other or name an unknown choice."""
