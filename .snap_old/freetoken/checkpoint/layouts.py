"""Hugging Face tensors whose name or layout differs from ours, per family.

GPT-OSS stores its experts transposed (``gate_up_proj`` E x H x 2I, gate and up interleaved
column by column; ``down_proj`` E x I x H; ``gate_up_proj_bias`` E x 2I interleaved): they
come out as our stacked ``gate_proj``/``up_proj`` (E x I x H), ``down_proj`` (E x H x I) and
``*_proj_bias``. Its MXFP4 experts (``*_blocks``, read as mxfp4 by the safetensors reader)
are stored output-major already (E x 2I x H, gate and up interleaved row by row; E x H x I):
their rows are split, never transposed, so the blocks stay whole. Gemma-4's multimodal
checkpoints keep the text decoder under ``model.language_model.``; the vision and audio towers
are not ours.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from freetoken.quant import QuantTensor

_OSS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks)?$")
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
           "model.embed_audio.")


def our_names(family: str, name: str) -> list[str]:
    """Our names of what checkpoint tensor ``name`` becomes (none, one, or two)."""
    if family == "gemma4":
        if name.startswith(_TOWERS):
            return []
        return [name.replace("model.language_model.", "model.", 1)]
    if family == "gpt_oss" and (m := _OSS.match(name)):
        stem, proj, suffix = m.groups()
        projs = ["gate_proj", "up_proj"] if proj == "gate_up_proj" else ["down_proj"]
        return [f"{stem}.{p}{'_bias' if suffix == '_bias' else ''}" for p in projs]
    return [name]


def to_ours(family: str, name: str, qt: QuantTensor) -> Iterator[tuple[str, QuantTensor]]:
    """Checkpoint tensor ``name`` as (our name, tensor) pairs."""
    names = our_names(family, name)
    if family != "gpt_oss" or not _OSS.match(name):
        yield from ((n, qt) for n in names)
        return
    t = qt.data
    if name.endswith(("_bias", "_blocks")):
        parts = [t[:, ::2], t[:, 1::2]] if len(names) == 2 else [t]
    elif len(names) == 2:
        parts = [t[:, :, ::2].transpose(1, 2), t[:, :, 1::2].transpose(1, 2)]
    else:
        parts = [t.transpose(1, 2)]
    for n, p in zip(names, parts, strict=True):
        p = p.contiguous()
        shape = (*p.shape[:-1], qt.shape[-1]) if name.endswith("_blocks") else tuple(p.shape)
        yield n, QuantTensor(qt.fmt, shape, p)
