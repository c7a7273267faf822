"""Signatures on the thinking blocks this server returns.

A thinking block's ``signature`` is an HMAC-SHA256 of its text under a secret drawn when the
server starts. A client sends earlier turns back with their thinking blocks; a block whose
signature does not match its text (edited, from another server, or from before a restart) is
refused, so what is rendered into the prompt as the model's own reasoning is what the model
wrote.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets


class ThinkingSigner:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def sign(self, thinking: str) -> str:
        digest = hmac.new(self._key, thinking.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def valid(self, thinking: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(thinking), signature)
