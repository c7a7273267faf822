"""Write a model as a single GGUF file the way llama.cpp's converter lays it out.

Used by ``ft synth`` and by tests that turn a ``transformers`` checkpoint into GGUF. Tensors are
streamed: all tensor infos go into the header first, then each tensor is produced, encoded and
written one at a time, so a file larger than RAM can be written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from freetoken.checkpoint.names import DERIVED, ours_to_gguf
from freetoken.config import ModelConfig
from freetoken.quant import gguf_quantize, gguf_row_bytes, gguf_type_of

_ARCH = {"qwen3_moe": "qwen3moe", "gemma3": "gemma3", "gemma4": "gemma4", "gpt_oss": "gpt-oss"}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: our name, logical shape, target format name."""

    name: str
    shape: tuple[int, ...]
    fmt: str


def gguf_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """The architecture keys llama.cpp reads for ``cfg`` (inverse of ModelConfig.from_gguf)."""
    a = _ARCH[cfg.family]
    meta: dict[str, Any] = {
        f"{a}.block_count": cfg.num_layers,
        f"{a}.context_length": cfg.max_position,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_heads,
        f"{a}.attention.head_count_kv": cfg.num_kv_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.freq_base": float(cfg.rope_theta),
    }
    if cfg.family == "qwen3_moe":
        meta |= {
            f"{a}.expert_count": cfg.num_experts,
            f"{a}.expert_used_count": cfg.top_k,
            f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        }
    if cfg.family == "gemma3":
        meta[f"{a}.attention.sliding_window"] = cfg.sliding_window
    if cfg.family in ("gemma4", "gpt_oss") and cfg.num_experts:
        meta |= {
            f"{a}.expert_count": cfg.num_experts,
            f"{a}.expert_used_count": cfg.top_k,
            f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
        }
    if cfg.family == "gemma4":
        meta |= _gemma4_metadata(cfg, a)
    if cfg.family == "gpt_oss":
        assert cfg.rope_full is not None
        meta |= {
            f"{a}.feed_forward_length": cfg.moe_intermediate_size,
            f"{a}.attention.sliding_window": cfg.sliding_window,
            f"{a}.rope.freq_base": float(cfg.rope_full.theta),
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(cfg.rope_full.factor),
            f"{a}.rope.scaling.original_context_length": cfg.rope_full.original_max_position,
            f"{a}.swiglu_clamp_exp": [float(cfg.swiglu_limit)] * cfg.num_layers,
        }
    return meta


def _gemma4_metadata(cfg: ModelConfig, a: str) -> dict[str, Any]:
    """Full layers' head size in key_length, sliding layers' in key_length_swa, as llama.cpp's
    converter writes them."""
    assert cfg.rope_full is not None and cfg.rope_sliding is not None
    n = cfg.num_layers
    full = next((i for i in range(n) if not cfg.sliding_layers[i]), n - 1)
    swa = next((i for i in range(n) if cfg.sliding_layers[i]), full)
    return {
        f"{a}.attention.head_count_kv": [cfg.kv_heads_of(i) for i in range(n)],
        f"{a}.attention.key_length": cfg.head_dim_of(full),
        f"{a}.attention.value_length": cfg.head_dim_of(full),
        f"{a}.attention.key_length_swa": cfg.head_dim_of(swa),
        f"{a}.attention.value_length_swa": cfg.head_dim_of(swa),
        f"{a}.rope.freq_base": float(cfg.rope_full.theta),
        f"{a}.rope.freq_base_swa": float(cfg.rope_sliding.theta),
        f"{a}.rope.dimension_count": cfg.head_dim_of(full),
        f"{a}.rope.dimension_count_swa": cfg.head_dim_of(swa),
        f"{a}.attention.sliding_window": cfg.sliding_window,
        f"{a}.attention.sliding_window_pattern": list(cfg.sliding_layers),
        f"{a}.attention.shared_kv_layers": 0,
        f"{a}.embedding_length_per_layer_input": 0,
        f"{a}.final_logit_softcapping": float(cfg.final_logit_softcapping),
    }


def derived_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Tensors llama.cpp's converter makes from the config (names in ``names.DERIVED``):
    Gemma-4's ``rope_freqs`` (1 on the full layers' rotated pairs, 1e30 on the others)."""
    if cfg.family != "gemma4" or cfg.rope_full is None:
        return {}
    full = next((i for i in range(cfg.num_layers) if not cfg.sliding_layers[i]), 0)
    half = cfg.head_dim_of(full) // 2
    turned = int(cfg.rope_full.fraction * half)
    return {DERIVED[0]: torch.tensor([1.0] * turned + [1e30] * (half - turned))}


def write_gguf(
    path: str | Path, cfg: ModelConfig, plans: Iterable[TensorPlan],
    make: Callable[[TensorPlan], torch.Tensor], extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``cfg``'s metadata, ``extra`` keys (e.g. the tokenizer) and one tensor per plan.

    ``make(plan)`` returns the float tensor for a plan (HF conventions, e.g. Gemma norm ``w``);
    it is called once per plan, in order, while the data section is written.
    """
    path = Path(path)
    arch = _ARCH[cfg.family]
    derived = derived_tensors(cfg)
    plans = list(plans) + [TensorPlan(n, tuple(t.shape), "f32") for n, t in derived.items()]
    make_given = make

    def make(p: TensorPlan) -> torch.Tensor:
        return derived[p.name] if p.name in derived else make_given(p)

    w = GGUFWriter(path, arch)
    for key, value in {**gguf_metadata(cfg), **(extra or {})}.items():
        add_metadata(w, key, value)
    for p in plans:
        row, gguf_type = gguf_row_bytes(p.fmt, p.shape[-1]), gguf_type_of(p.fmt)
        if gguf_type is None:
            raise ValueError(f"{p.name}: format {p.fmt} has no GGUF encoding; write it in "
                             "another format")
        nbytes = int(np.prod(p.shape[:-1], dtype=np.int64)) * row
        w.add_tensor_info(ours_to_gguf(p.name, cfg.family), (*p.shape[:-1], row),
                          np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType(gguf_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for p in plans:
        w.write_tensor_data(_encode(make(p), p, cfg.family).numpy())
    w.close()
    return path


def _encode(x: torch.Tensor, p: TensorPlan, family: str) -> torch.Tensor:
    """Quantise ``x`` on its own device ~64 MiB of rows at a time; bytes on the CPU."""
    rows = x.reshape(-1, p.shape[-1])
    out = torch.empty(rows.shape[0], gguf_row_bytes(p.fmt, rows.shape[1]), dtype=torch.uint8)
    step = max(1, (64 << 20) // (4 * rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        r = rows[i:i + step].float()
        if family == "gemma3" and p.name.endswith("norm.weight"):
            r = r + 1.0  # llama.cpp stores Gemma's norm scale as 1 + w
        out[i:i + step] = gguf_quantize(p.fmt, r).cpu()
    return out


def add_metadata(w: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write GGUF metadata {key}={value!r}")
