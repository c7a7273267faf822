"""Single-file GGUF checkpoints, memory-mapped.

The header parser is ours (the format is small and documented by ggml; the ``gguf`` package's
reader spends ~15 s materialising a 262k-token vocabulary as numpy views). Tensor data is never
copied: each tensor is a torch view into one private (copy-on-write) mapping of the file,
except where GGUF's blocks are not our layout of the format (NVFP4): those are repacked into
it each time they are read (``quant.gguf_read``), so ``tensor_infos`` answers from the header.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.checkpoint.base import TensorInfo
from freetoken.checkpoint.names import gguf_to_ours
from freetoken.checkpoint.tokenizer import load_gguf_tokenizer
from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError
from freetoken.quant import (
    QuantTensor,
    format_for_gguf_type,
    gguf_read,
    gguf_read_nbytes,
    gguf_row_bytes,
)

_MAGIC = b"GGUF"
# GGUF value types: id -> struct code (scalars); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
            10: "Q", 11: "q", 12: "d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
       6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


class _Cursor:
    """Reads little-endian GGUF fields from a buffer; every overrun is a CheckpointError."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise CheckpointError(
                f"{self.path} is truncated or corrupt (header runs past the end of the file "
                f"at byte {self.pos}); download or convert it again"
            )
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.scalar("I"), self.scalar("Q")
            if itype in _NP:
                size = np.dtype(_NP[itype]).itemsize
                return np.frombuffer(self.take(count * size), dtype=_NP[itype]).tolist()
            return [self.value(itype) for _ in range(count)]
        raise CheckpointError(f"{self.path} is corrupt: unknown GGUF value type {vtype}")


# Tokens that end a generation besides tokenizer.ggml.eos_token_id, found by their text in the
# vocabulary as llama.cpp does (llama-vocab.cpp): the chat formats' end-of-turn markers. A
# GPT-OSS turn ends at <|return|> or <|call|>; its <|end|> closes a message mid-turn.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
               "<|endoftext|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>")
END_OF_TURN_BY_ARCH = {"gpt-oss": ("<|return|>", "<|call|>")}
CONTROL_TYPES = (3, 4)  # tokenizer.ggml.token_type: control, user-defined


def end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    """Ids of the vocabulary's end-of-turn tokens (special tokens only, never plain text)."""
    names = END_OF_TURN_BY_ARCH.get(str(meta.get("general.architecture")), END_OF_TURN)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    wanted = set(names)
    return [i for i, t in enumerate(tokens)
            if t in wanted and (i >= len(types) or types[i] in CONTROL_TYPES)]


class GGUFCheckpoint:
    """A ``.gguf`` file: metadata, config, tensors as zero-copy views, tokenizer."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot open GGUF file {self.path}: {e}") from e
        self.metadata, self._infos = self._parse(memoryview(self._map))
        # facts llama.cpp takes from the tensors rather than the keys
        self.metadata["_tied_output"] = not any(n == "output.weight" for n, *_ in self._infos)
        embd = [ne for n, ne, *_ in self._infos if n == "token_embd.weight"]
        if embd:
            self.metadata["_vocab_size"] = embd[0][-1]
        self.metadata["_moe_layers"] = {
            int(n.split(".")[1]) for n, *_ in self._infos if n.endswith(".ffn_gate_exps.weight")
        }
        names = {n for n, *_ in self._infos}
        blocks = int(self.metadata.get(f"{self.metadata.get('general.architecture')}.block_count")
                     or 0)
        # Gemma-4: full layers without attn_v take v from k's projection
        self.metadata["_k_eq_v"] = any(f"blk.{i}.attn_v.weight" not in names
                                       for i in range(blocks))
        self.metadata["_end_of_turn_ids"] = end_of_turn_ids(self.metadata)
        freqs = [i for i in self._infos if i[0] == "rope_freqs.weight"]
        if freqs:
            self.metadata["_rope_freqs"] = self._as_float(self._view(*freqs[0])).tolist()
        self.config = ModelConfig.from_gguf(self.metadata)
        self.family = self.config.family
        for name, _, ttype, _ in self._infos:
            if gguf_to_ours(name, self.family) is not None:
                try:
                    format_for_gguf_type(ttype)
                except ValueError as e:
                    raise CheckpointError(f"{self.path}: tensor {name}: {e}") from e
        self.chat_template: str | None = self.metadata.get("tokenizer.chat_template")
        self.generation_config: dict[str, Any] = {}

    def _parse(
        self, buf: memoryview
    ) -> tuple[dict[str, Any], list[tuple[str, list[int], int, int]]]:
        c = _Cursor(buf, self.path)
        if bytes(c.take(4)) != _MAGIC:
            raise CheckpointError(
                f"{self.path} is not a GGUF file (bad magic); pass a .gguf file or an HF directory"
            )
        version = c.scalar("I")
        if version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            ne = [c.scalar("Q") for _ in range(c.scalar("I"))]
            infos.append((name, ne, c.scalar("I"), c.scalar("Q")))
        align = int(meta.get("general.alignment", 32))
        self._data_start = (c.pos + align - 1) // align * align
        for name, ne, ttype, offset in infos:
            end = self._data_start + offset + _nbytes(ne, ttype, name, self.path)
            if end > len(buf):
                raise CheckpointError(
                    f"{self.path} is truncated: tensor {name} ends at byte {end} but the file "
                    f"has {len(buf)}; download or convert it again"
                )
        return meta, infos

    def tensor_names(self) -> list[str]:
        return [n for n in (gguf_to_ours(i[0], self.family) for i in self._infos) if n]

    def tensor_infos(self) -> Iterator[TensorInfo]:
        for name, ne, ttype, _ in self._infos:
            ours = gguf_to_ours(name, self.family)
            if ours is None:
                continue
            shape = tuple(reversed(ne))
            if self._shifted_norm(ours):
                yield TensorInfo(ours, "f32", shape, 4 * math.prod(shape))
                continue
            fmt = format_for_gguf_type(ttype).name
            try:
                nbytes = gguf_read_nbytes(fmt, shape, _nbytes(ne, ttype, name, self.path))
            except ValueError as e:
                raise CheckpointError(f"{self.path}: tensor {name}: {e}") from e
            yield TensorInfo(ours, fmt, shape, nbytes)

    def tensors(self) -> Iterator[tuple[str, QuantTensor]]:
        for name, ne, ttype, offset in self._infos:
            ours = gguf_to_ours(name, self.family)
            if ours is None:
                continue
            t = self._view(name, ne, ttype, offset)
            if self._shifted_norm(ours):
                t = QuantTensor("f32", t.shape, self._as_float(t) - 1.0)
            yield ours, t

    def _shifted_norm(self, ours: str) -> bool:
        """llama.cpp's converter stores Gemma-3's (1 + w) norm scale; we keep w (float32)."""
        return self.family == "gemma3" and ours.endswith("norm.weight")

    def stored_tensors(self) -> Iterator[tuple[str, QuantTensor]]:
        """Every tensor under its GGUF name, exactly as stored (Gemma norms stay ``1 + w``)."""
        for name, ne, ttype, offset in self._infos:
            yield name, self._view(name, ne, ttype, offset)

    def _view(self, name: str, ne: list[int], ttype: int, offset: int) -> QuantTensor:
        fmt = format_for_gguf_type(ttype)
        shape = tuple(reversed(ne))
        nbytes = _nbytes(ne, ttype, name, self.path)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes,
                               offset=self._data_start + offset)
        if fmt.name in _FLOAT_DTYPES:
            return QuantTensor(fmt.name, shape, raw.view(_FLOAT_DTYPES[fmt.name]).view(shape))
        try:
            return gguf_read(fmt.name, raw.view(*shape[:-1], gguf_row_bytes(fmt.name, shape[-1])),
                             shape)
        except ValueError as e:
            raise CheckpointError(f"{self.path}: tensor {name}: {e}") from e

    @staticmethod
    def _as_float(t: QuantTensor) -> torch.Tensor:
        from freetoken.quant import get_format

        return get_format(t.fmt).dequantize(t)

    def tokenizer(self) -> Any:
        return load_gguf_tokenizer(self.path)


def _nbytes(ne: list[int], ttype: int, name: str, path: Path) -> int:
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: tensor {name} has unknown GGML type id {ttype}") from e
    if ne and ne[0] % block:
        raise CheckpointError(f"{path}: tensor {name} row of {ne[0]} is not a whole block")
    return int(np.prod(ne, dtype=np.int64)) // block * size
