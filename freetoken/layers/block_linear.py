"""A dense linear layer on a GPU whose Q8_0 checkpoint weight stays as blocks (regrouped as
Q8_0x8, ``quant/q8_0x8.py``): decode reads the bytes once through the fused kernel
(``kernels/gather_gemv.py:dense_gemv``), half of what the bf16 weight it replaces would move;
longer inputs (prefill) dequantise it and multiply in torch.

:func:`use_block_linears` swaps them in before the weights load (FREETOKEN_GPU_DENSE=blocks), for
the matrices the checkpoint stores as Q8_0 in whole 256-weight groups; routers stay bf16 (the
resident path's top-k). The slow twin is :class:`~freetoken.layers.linear.Linear` on the same
checkpoint tensor (weights dequantised at load).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.checkpoint.base import Checkpoint
from freetoken.kernels.gather_gemv import DENSE_TOKENS, dense_gemv
from freetoken.layers import linear
from freetoken.layers.linear import Linear
from freetoken.quant import QuantTensor, dequantize_as
from freetoken.quant.q8_0x8 import regroup, regroups


def block_product(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for W's Q8_0x8 rows ``blocks`` (R, K // 256 * 272) uint8, x (..., K)."""
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    if flat.shape[0] <= DENSE_TOKENS:
        y = dense_gemv(blocks, flat.contiguous())
    else:
        y = F.linear(flat, dequantize_as(QuantTensor("q8_0x8", (blocks.shape[0], K), blocks),
                                         x.dtype))
    return y.reshape(*lead, blocks.shape[0])


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` for W as a float matrix or as Q8_0x8 rows (uint8): a stacked q/k/v."""
    return block_product(x, weight) if weight.dtype == torch.uint8 else F.linear(x, weight)


class BlockLinear(nn.Module):
    """``y = x @ W^T``, W (out_features, in_features) a Q8_0 checkpoint matrix kept as Q8_0x8
    rows in ``blocks`` (its own, or its rows of a stack it shares)."""

    def __init__(self, in_features: int, out_features: int,
                 blocks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.blocks = blocks if blocks is not None else torch.empty(
            out_features, in_features // 256 * 272, dtype=torch.uint8)
        self.loaded = False

    def load_weight_tensor(self, qt: QuantTensor) -> None:
        if qt.fmt != "q8_0" or tuple(qt.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a {qt.fmt} weight of shape {tuple(qt.shape)} for a Q8_0 block "
                             f"layer of {(self.out_features, self.in_features)}")
        self.blocks.copy_(regroup(qt.data.to(self.blocks.device)))
        self.loaded = True

    def missing_weight(self) -> bool:
        return not self.loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_product(x, self.blocks)


def use_block_linears(model: nn.Module, ckpt: Checkpoint) -> int:
    """Swap the model's bias-free GPU ``Linear`` layers whose checkpoint weight is Q8_0 in whole
    256-weight groups for :class:`BlockLinear` (routers excepted), and stack an attention's q,
    k and v blocks where all three are swapped (its ``qkv``). Call before loading the weights;
    returns how many were swapped."""
    formats = {t.name: t.fmt for t in ckpt.tensor_infos()}
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is not Linear or module.bias is not None \
                or not linear.stacks(module.weight) or name.endswith("mlp.gate"):
            continue
        out_f, in_f = module.weight.shape
        if formats.get(f"{name}.weight") != "q8_0" or not regroups(in_f):
            continue
        parent_name, _, attr = name.rpartition(".")
        with torch.device(module.weight.device):
            setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                    BlockLinear(in_f, out_f))
        swapped += 1
    for module in model.modules():
        members = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if getattr(module, "qkv", None) is not None \
                and all(isinstance(m, BlockLinear) for m in members):
            module.qkv = stack_blocks(members)  # type: ignore[arg-type]
    return swapped


def stack_blocks(members: list[BlockLinear]) -> torch.Tensor:
    """One (sum of out, row bytes) block stack whose row ranges become ``members``' blocks."""
    first = members[0].blocks
    stacked = torch.empty(sum(m.out_features for m in members), first.shape[1],
                          dtype=torch.uint8, device=first.device)
    start = 0
    for m in members:
        m.blocks = stacked[start:start + m.out_features]
        start += m.out_features
    return stacked
