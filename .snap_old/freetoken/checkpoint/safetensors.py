"""Hugging Face checkpoint directories: config.json, (sharded) *.safetensors, tokenizer files.

Each safetensors file is mapped once (private, copy-on-write) and every tensor is a torch view
into that mapping. Formats that keep scales in companion tensors are grouped here:
``w.weight`` (float8) + ``w.weight_scale_inv`` is fp8_block; ``w.weight`` (uint8) +
``w.weight_scale`` + ``w.weight_scale_2`` is nvfp4; ``w_blocks`` (uint8) + ``w_scales`` is
mxfp4 (GPT-OSS), repacked into our blocks as it is read. A companion may sit in another shard.
``tensor_infos`` runs the same grouping and layouts on meta tensors of the header's shapes and
dtypes, so its formats, shapes and sizes are ``tensors()``'s with no byte read or repacked.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from freetoken.checkpoint.base import TensorInfo
from freetoken.checkpoint.layouts import our_names, to_ours
from freetoken.checkpoint.tokenizer import load_hf_tokenizer
from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.quant import QuantTensor
from freetoken.quant.mxfp4 import from_split_blocks

_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
_FMT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_COMPANIONS = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")


class _SafetensorsFile:
    """One mapped file: header entries and zero-copy tensor views."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open {path}: {e}") from e
        size = len(self.map)
        bad = f"{path} is truncated or corrupt"
        if size < 8:
            raise CheckpointError(f"{bad} ({size} bytes); download it again")
        (n,) = struct.unpack("<Q", self.map[:8])
        if 8 + n > size:
            raise CheckpointError(f"{bad} (header of {n} bytes in a {size}-byte file)")
        try:
            header = json.loads(bytes(self.map[8:8 + n]))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{bad} (unreadable header: {e}); download it again") from e
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: dict[str, dict[str, Any]] = header
        for name, e in header.items():
            if e.get("dtype") not in _DTYPES:
                raise CheckpointError(
                    f"{path}: tensor {name} has unsupported dtype {e.get('dtype')!r} "
                    f"(supported: {', '.join(_DTYPES)})"
                )
            if self.base + e["data_offsets"][1] > size:
                raise CheckpointError(f"{bad}: tensor {name} runs past the end; download it again")

    def view(self, name: str, meta: bool = False) -> torch.Tensor:
        """The tensor's bytes as its dtype and shape; ``meta``: only the dtype and shape."""
        e = self.entries[name]
        start, end = e["data_offsets"]
        if meta:
            return torch.empty(e["shape"], dtype=_DTYPES[e["dtype"]], device="meta")
        if end == start:
            raw = torch.empty(0, dtype=torch.uint8)
        else:
            raw = torch.frombuffer(self.map, dtype=torch.uint8, count=end - start,
                                   offset=self.base + start)
        return raw.view(_DTYPES[e["dtype"]]).view(e["shape"])


class HFCheckpoint:
    """A Hugging Face model directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(
                f"{self.path} has no config.json; "
                "pass a Hugging Face model directory or a .gguf file"
            )
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
        gen = self.path / "generation_config.json"
        try:
            self.generation_config: dict[str, Any] = \
                json.loads(gen.read_text()) if gen.exists() else {}
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{gen} is not valid JSON: {e}") from e
        self.config = ModelConfig.from_hf(self.hf_config, self.generation_config)
        files = sorted(self.path.glob("*.safetensors"))
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            wanted = sorted({self.path / f for f in weight_map.values()})
            missing = [str(f.name) for f in wanted if not f.exists()]
            if missing:
                raise CheckpointError(
                    f"{self.path}: shards listed in model.safetensors.index.json are missing: "
                    f"{', '.join(missing)}"
                )
            files = wanted
        if not files:
            raise CheckpointError(f"{self.path} has no *.safetensors weights")
        self._files = [_SafetensorsFile(f) for f in files]
        self._where = {n: f for f in self._files for n in f.entries}
        self.chat_template = _chat_template(self.path)

    def tensor_names(self) -> list[str]:
        fam = self.config.family
        return [o for f in self._files for n in f.entries if not self._companion(n)
                for o in our_names(fam, n)]

    def tensor_infos(self) -> Iterator[TensorInfo]:
        for name, qt in self._read(meta=True):
            yield TensorInfo(name, qt.fmt, tuple(qt.shape), qt.nbytes)

    def tensors(self) -> Iterator[tuple[str, QuantTensor]]:
        return self._read(meta=False)

    def _read(self, meta: bool) -> Iterator[tuple[str, QuantTensor]]:
        fam = self.config.family
        for f in self._files:
            for name in f.entries:
                if self._companion(name) or not our_names(fam, name):
                    continue
                yield from to_ours(fam, name, self._tensor(f, name, meta))

    def _companion(self, name: str) -> bool:
        return name.endswith(_COMPANIONS) or (
            name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in self._where)

    def _view(self, name: str, meta: bool) -> torch.Tensor:
        return self._where[name].view(name, meta)

    def _tensor(self, f: _SafetensorsFile, name: str, meta: bool) -> QuantTensor:
        data = f.view(name, meta)
        stem = name.removesuffix("weight")
        if stem + "weight_scale_inv" in self._where:
            return QuantTensor("fp8_block", tuple(data.shape), data,
                               {"weight_scale_inv": self._view(stem + "weight_scale_inv", meta)})
        if data.dtype == torch.uint8 and stem + "weight_scale" in self._where:
            scales = {k: self._view(stem + k, meta) for k in ("weight_scale", "weight_scale_2")}
            return QuantTensor("nvfp4", (data.shape[0], data.shape[1] * 2), data, scales)
        if name.endswith("_blocks") and (scales := name.removesuffix("_blocks") + "_scales") \
                in self._where:
            try:
                return from_split_blocks(data, self._view(scales, meta))
            except ValueError as e:
                raise CheckpointError(f"{f.path}: tensor {name}: {e}") from e
        if data.dtype not in _FMT:
            raise CheckpointError(f"{f.path}: tensor {name} of dtype {data.dtype} is not a weight")
        return QuantTensor(_FMT[data.dtype], tuple(data.shape), data)

    def tokenizer(self) -> Any:
        return load_hf_tokenizer(self.path)


def _chat_template(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    tc = path / "tokenizer_config.json"
    if tc.exists():
        template = json.loads(tc.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None
