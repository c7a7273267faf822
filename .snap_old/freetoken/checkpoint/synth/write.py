"""Write a synth spec as a GGUF file or a sharded HF directory, streaming tensor by tensor."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from freetoken.checkpoint.gguf_writer import TensorPlan, write_gguf
from freetoken.checkpoint.synth.presets import (
    SynthSpec,
    hf_config,
    plan_bytes,
    tensor_plans,
)
from freetoken.checkpoint.synth.tokenizer import (
    gguf_tokenizer_metadata,
    hf_tokenizer_files,
)
from freetoken.checkpoint.synth.weights import Weights
from freetoken.config import ModelConfig
from freetoken.errors import ConfigError

SHARD_BYTES = 4 << 30


def write_synth(
    spec: SynthSpec, out: str | Path, overwrite: bool = False, progress: bool = False,
    shard_bytes: int = SHARD_BYTES, device: str = "cpu",
) -> Path:
    """Write ``spec`` to ``out``: a GGUF file if it ends in .gguf, else an HF directory."""
    out = Path(out)
    gguf = out.suffix == ".gguf"
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    if out.exists() and gguf != out.is_file():
        raise ConfigError(f"{out} exists and is a {'file' if out.is_file() else 'directory'}; "
                          "pick another --out")
    weights = Weights(spec, device)
    plans = tensor_plans(spec, stacked=gguf)
    bar = tqdm(total=sum(map(plan_bytes, plans)), desc=f"Writing {out.name}", unit="B",
               unit_scale=True, disable=not progress)

    def make(plan: TensorPlan) -> torch.Tensor:
        bar.update(plan_bytes(plan))
        with torch.device(device):
            return weights.make(plan.name, plan.shape)

    try:
        if gguf:
            partial = out.with_name(out.name + ".partial")
            cfg = ModelConfig.from_hf(hf_config(spec))
            extra = {"general.name": f"synth-{spec.preset.name}",
                     "freetoken.synth": json.dumps(hf_config(spec)["freetoken_synth"]),
                     **gguf_tokenizer_metadata(spec)}
            write_gguf(partial, cfg, plans, make, extra)
            os.replace(partial, out)
        else:
            _write_hf(spec, out, plans, make, shard_bytes)
    finally:
        bar.close()
    return out


def _write_hf(spec: SynthSpec, out: Path, plans: list[TensorPlan],
              make: Callable[[TensorPlan], torch.Tensor], shard_bytes: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()
    shards: list[list[TensorPlan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + plan_bytes(p) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += plan_bytes(p)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        _write_safetensors(out / name, shard, make)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(map(plan_bytes, plans))},
                 "weight_map": {p.name: n for n, s in zip(names, shards, strict=True) for p in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    hf_tokenizer_files(spec, out)


def _write_safetensors(path: Path, plans: list[TensorPlan],
                       make: Callable[[TensorPlan], torch.Tensor]) -> None:
    """Header first (every offset is known from the shapes), then one tensor at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        header[p.name] = {"dtype": "BF16", "shape": list(p.shape),
                          "data_offsets": [offset, offset + plan_bytes(p)]}
        offset += plan_bytes(p)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for p in plans:
            make(p).to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy().tofile(f)


