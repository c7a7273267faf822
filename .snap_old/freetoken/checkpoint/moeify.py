"""Turn a dense Gemma-3 GGUF into an MoE that computes the same function as the dense model.

Every layer's MLP becomes E experts, each a copy of the dense MLP with its intermediate neurons
in an order of its own: neuron j of expert e is dense neuron p = perm_e[j], and gate rows, up rows
and down columns move together, so for every expert

    expert_e(x) = sum_j down[:, p] * act(gate[p] . x) * (up[p] . x) = mlp(x).

The router is random. Its top-k weights are renormalised to sum to 1, so the block returns
sum_a w_a * mlp(x) = mlp(x), and the MoE model's text is the dense model's (up to the order of
float sums). An MoE strategy that pairs one expert's gate or up with another's down, reads
another expert's or layer's bank, or gives a token another token's rows changes that text.
(A wrong top-k weight does not: Gemma-3 normalises the MLP's output, which divides out a scale.)

gate and up rows are moved in their stored block format (a row is whole blocks), which is
exact. down's columns run along the blocks, so down is dequantised to float32, permuted and
written as float32, which is exact too. Every other tensor is copied byte for byte, and every
metadata key with its value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from freetoken.checkpoint.gguf import GGUFCheckpoint
from freetoken.checkpoint.gguf_writer import add_metadata
from freetoken.errors import CheckpointError
from freetoken.quant import QuantTensor, get_format, gguf_row_bytes, gguf_type_of, gguf_write

# Router weights are N(0, ROUTER_STD^2). On Gemma-3 270M a token's router logits then spread
# by ~0.3-2 across the experts (by layer): the top-k weights vary between tokens, as a trained
# router's do, without collapsing onto one expert.
ROUTER_STD = 0.05

_DENSE_MLP = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.weight$")


@dataclass(frozen=True)
class _Out:
    """One tensor of the output: its logical shape and format up front, its data on demand."""

    shape: tuple[int, ...]
    fmt: str
    make: Callable[[], QuantTensor]


def moeify_gguf(
    src: str | Path, dst: str | Path, num_experts: int = 4, top_k: int = 2, seed: int = 0,
    router_std: float = ROUTER_STD,
) -> Path:
    """Write ``dst``: ``src`` (a dense Gemma-3 GGUF) with every MLP an MoE of ``num_experts``
    permuted copies, ``top_k`` routed, renormalised weights. Deterministic in ``seed``."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    dst = Path(dst)
    ckpt = GGUFCheckpoint(src)
    cfg = ckpt.config
    if cfg.family != "gemma3" or cfg.is_moe:
        raise CheckpointError(f"{ckpt.path} is not a dense Gemma-3 GGUF; nothing to moeify")
    arch = str(ckpt.metadata["general.architecture"])
    E, H, I_ = num_experts, cfg.hidden_size, cfg.intermediate_size
    stored = dict(ckpt.stored_tensors())
    gen = torch.Generator().manual_seed(seed)

    out = {name: _Out(t.shape, t.fmt, partial(_as_stored, t))
           for name, t in stored.items() if not _DENSE_MLP.match(name)}
    for layer in range(cfg.num_layers):
        blk = f"blk.{layer}"
        perms = [torch.randperm(I_, generator=gen) for _ in range(E)]
        router = torch.randn(E, H, generator=gen, dtype=torch.float32) * router_std
        out[f"{blk}.ffn_gate_inp.weight"] = _Out(
            (E, H), "f32", partial(QuantTensor, "f32", (E, H), router))
        for proj in ("gate", "up"):
            dense = stored[f"{blk}.ffn_{proj}.weight"]
            out[f"{blk}.ffn_{proj}_exps.weight"] = _Out(
                (E, I_, H), dense.fmt, partial(_rows, dense, perms))
        down = stored[f"{blk}.ffn_down.weight"]
        out[f"{blk}.ffn_down_exps.weight"] = _Out(
            (E, H, I_), "f32", partial(_columns, down, perms))

    meta = {k: v for k, v in ckpt.metadata.items()
            if not k.startswith("_") and k != "general.architecture"}  # the writer adds it
    meta |= {
        f"{arch}.expert_count": E,
        f"{arch}.expert_used_count": top_k,
        f"{arch}.expert_feed_forward_length": I_,
        f"{arch}.expert_weights_norm": True,
    }
    unfinished = dst.with_name(dst.name + ".partial")
    w = GGUFWriter(unfinished, arch)
    for key, value in meta.items():
        add_metadata(w, key, value)
    for name, o in out.items():
        gguf_type = gguf_type_of(o.fmt)
        assert gguf_type is not None  # every format here was read from a GGUF file
        row = gguf_row_bytes(o.fmt, o.shape[-1])
        w.add_tensor_info(name, (*o.shape[:-1], row), np.dtype(np.uint8),
                          int(np.prod(o.shape[:-1], dtype=np.int64)) * row,
                          raw_dtype=GGMLQuantizationType(gguf_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, o in out.items():
        t = o.make()
        if (tuple(t.shape), t.fmt) != (tuple(o.shape), o.fmt):
            raise AssertionError(f"{name}: made {t.fmt} {t.shape}, planned {o.fmt} {o.shape}")
        w.write_tensor_data(gguf_write(t).numpy())
    w.close()
    os.replace(unfinished, dst)
    return dst


def _as_stored(t: QuantTensor) -> QuantTensor:
    return t


def _rows(dense: QuantTensor, perms: list[torch.Tensor]) -> QuantTensor:
    """(I, H) gate/up -> (E, I, H) in the same format: expert e's row j is dense row perm_e[j]."""
    data = torch.stack([dense.data[p] for p in perms])
    return QuantTensor(dense.fmt, (len(perms), *dense.shape), data)


def _columns(dense: QuantTensor, perms: list[torch.Tensor]) -> QuantTensor:
    """(H, I) down -> (E, H, I) float32: expert e's column j is dense column perm_e[j]."""
    full = get_format(dense.fmt).dequantize(dense).float()
    data = torch.stack([full[:, p] for p in perms]).contiguous()
    return QuantTensor("f32", (len(perms), *dense.shape), data)
