"""Resident experts: both fast paths against the one-pair-at-a-time slow twin."""

from __future__ import annotations

import pytest
import torch

from freetoken.errors import ConfigError
from freetoken.kernels.expert_matmul import GATHER_MAX_PAIRS, gathered, grouped
from freetoken.moe.registry import make_experts
from freetoken.moe.resident import ResidentExperts, reference_experts
from freetoken.moe.strategy import ExpertShape


def _experts(dtype: torch.dtype, act: str = "silu") -> ResidentExperts:
    torch.manual_seed(0)
    e = ResidentExperts(ExpertShape(0, num_experts=16, hidden=64, intermediate=48, top_k=4,
                                    activation=act))
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * 0.1)
    return e.to(dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("tokens", [1, 2, 4, 9, 33])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_fast_paths_match_slow_twin(tokens, act, device):
    e = _experts(torch.float32, act).to(device)
    x = torch.randn(tokens, 64, device=device)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(tokens)]).to(device)
    w = torch.softmax(torch.randn(tokens, 4), -1).to(device)
    small = tokens * 4 <= GATHER_MAX_PAIRS
    flat = ids.reshape(-1)
    got = (gathered(x, w, e.gate_proj[flat], e.up_proj[flat], e.down_proj[flat], e.act)
           if small else e(x, ids, w))
    path = "gathered" if small else "grouped"
    torch.testing.assert_close(got, reference_experts(e, x, ids, w), atol=1e-5, rtol=1e-5,
                               msg=f"{path} path")
    torch.testing.assert_close(grouped(x, ids, w, 16, e._weights, e.act), got, atol=1e-5,
                               rtol=1e-5)


def test_bf16_close_to_float32_twin():
    e = _experts(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(16)[:4] for _ in range(8)])
    w = torch.softmax(torch.randn(8, 4), -1).to(torch.bfloat16)
    torch.testing.assert_close(e(x, ids, w).float(), reference_experts(e, x, ids, w),
                               atol=2e-2, rtol=2e-2)


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ConfigError, match=r"'hybird' \(choose from .*resident"):
        make_experts("hybird", ExpertShape(0, 2, 8, 8, 1, "silu"))
