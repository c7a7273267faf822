"""Helpers shared by the MoE strategy tests."""

from __future__ import annotations

import torch

from freetoken.cpu import executor as cx
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.strategy import ExpertShape, LayerPlan, Shared
from freetoken.quant import get_format


def q8_cpu_layer(shape: ExpertShape, pool: cx.CpuMoeExecutor, seed: int) -> CpuExperts:
    """A cpu-strategy layer of ``shape`` on ``pool``: random q8_0 experts (generator ``seed``)."""
    experts = CpuExperts(shape)
    g = torch.Generator().manual_seed(seed)
    E, H, I_ = shape.num_experts, shape.hidden, shape.intermediate
    q8 = get_format("q8_0")
    for name, dims in (("gate_proj", (E, I_, H)), ("up_proj", (E, I_, H)),
                       ("down_proj", (E, H, I_))):
        experts.load_expert_tensor(name, q8.quantize(torch.randn(dims, generator=g) / 8))
    experts.attach(LayerPlan("cpu"), Shared(pool=pool))
    return experts
