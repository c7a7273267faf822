"""Convert an opened checkpoint to GGUF, choosing a format per tensor.

Per-expert Hugging Face tensors are stacked into llama.cpp's (E, out, in) expert tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from freetoken.checkpoint.base import Checkpoint
from freetoken.checkpoint.gguf_writer import TensorPlan, write_gguf
from freetoken.quant import QuantTensor, get_format

_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def convert_to_gguf(
    ckpt: Checkpoint, out: str | Path, fmt_for: Callable[[str, tuple[int, ...]], str]
) -> Path:
    """Write ``ckpt`` to ``out``; ``fmt_for(our_name, shape)`` picks each tensor's format."""
    singles: dict[str, QuantTensor] = {}
    experts: dict[str, dict[int, QuantTensor]] = {}
    for name, qt in ckpt.tensors():
        if m := _PER_EXPERT.match(name):
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = qt
        elif name == "lm_head.weight" and ckpt.config.tie_word_embeddings:
            continue
        else:
            singles[name] = qt
    shapes = {n: q.shape for n, q in singles.items()}
    for n, per in experts.items():
        shapes[n] = (len(per), *per[0].shape)
    plans = [TensorPlan(n, tuple(s), fmt_for(n, tuple(s))) for n, s in shapes.items()]

    def make(p: TensorPlan) -> torch.Tensor:
        if p.name in singles:
            return _dequant(singles[p.name])
        per = experts[p.name]
        return torch.stack([_dequant(per[e]) for e in range(len(per))])

    return write_gguf(out, ckpt.config, plans, make)


def _dequant(qt: QuantTensor) -> torch.Tensor:
    return get_format(qt.fmt).dequantize(qt)
