"""Fixtures shared by the MoE strategy tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gather_on_cpu(monkeypatch):
    """Decode calls take the GPU's path on the CPU: the host plans and publishes the slot
    table, the device part gathers through it (resident gathers too, for the same kernel)."""
    from freetoken.kernels.expert_matmul import GATHER_MAX_PAIRS
    from freetoken.moe import offload, resident

    def small(x: torch.Tensor, ids: torch.Tensor) -> bool:
        return ids.numel() <= GATHER_MAX_PAIRS

    monkeypatch.setattr(offload, "use_gather", small)
    monkeypatch.setattr(resident, "use_gather", small)
