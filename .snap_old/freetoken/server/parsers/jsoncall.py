"""Reading a tool call's JSON: what counts as well formed, for every family that writes JSON."""

from __future__ import annotations

import json
from typing import Any


def arguments_json(args: Any) -> str | None:
    """Arguments as the JSON object text the API sends, or None if they are not an object.

    Models write the object itself and, now and then, the object already encoded as a string;
    both are the same call.
    """
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def named_call(body: str) -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` as ``(name, arguments JSON)``; None if malformed.

    ``parameters`` is read where ``arguments`` is missing (some fine-tunes write it), and a call
    without either has no arguments.
    """
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    encoded = arguments_json(args)
    return None if encoded is None else (obj["name"], encoded)
