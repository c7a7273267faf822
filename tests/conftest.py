"""Shared fixtures: tiny random checkpoints written by ``transformers`` itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (numpy on the CPU). It must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], max_position_embeddings=256, rope_theta=10000.0,
    )
    model = Qwen3MoeForCausalLM(cfg)
    _randomise_norms(model)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=5,
        max_position_embeddings=256, query_pre_attn_scalar=16,
    )
    model = Gemma3ForCausalLM(cfg)
    _randomise_norms(model)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return path


def _randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 0 or 1; random ones catch a mixed-up norm."""
    offset = 0.0 if "gemma" in type(model).__name__.lower() else 1.0  # Gemma scales by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3 + offset)
