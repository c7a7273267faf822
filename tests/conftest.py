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
def wide_qwen3_moe_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE GGUF whose rows are whole 256-weight groups (every width 256), every
    matrix but the embedding Q8_0, norms f32: what Q8_0x8 regroups (resident experts, dense
    block layers)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from freetoken.checkpoint import open_checkpoint
    from freetoken.checkpoint.convert import convert_to_gguf

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("wide_qwen3_moe")
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    out = path / "m.gguf"
    convert_to_gguf(open_checkpoint(path), out,
                    lambda n, s: "q8_0" if len(s) >= 2 and "embed" not in n else "f32")
    return out


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


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma-4 MoE (26B-A4B's shape of things): sliding layers of head 16 and 2 KV heads, full
    layers of head 32 and 1 KV head with v from k's projection and a quarter of the pairs
    rotating, the dense MLP beside 8 experts (top 2), logit soft-capping."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    cfg = Gemma4TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True,
        num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=5,
        hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
        max_position_embeddings=256,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
        + ["full_attention"],
    )
    model = Gemma4ForCausalLM(cfg)
    _randomise(model, r"norm\.weight$|router\.scale$|per_expert_scale$|layer_scalar$", 1.0)
    path = tmp_path_factory.mktemp("gemma4")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-OSS: sliding (window 5) and full layers in turn, sinks, yarn rope, 8 biased experts
    (top 2) with the clamp low enough to bite."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=5, max_position_embeddings=256,
        swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 32},
    )
    model = GptOssForCausalLM(cfg)
    _randomise(model, r"norm\.weight$", 1.0)
    _randomise(model, r"sinks$|_bias$|\.bias$", 0.0)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gpt_oss_mxfp4(tiny_gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-OSS as a GGUF with mxfp4 experts (the format its checkpoints ship)."""
    from freetoken.checkpoint import open_checkpoint
    from freetoken.checkpoint.convert import convert_to_gguf

    out = tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m.gguf"
    return convert_to_gguf(open_checkpoint(tiny_gpt_oss), out, lambda n, s: "mxfp4"
                           if ".experts." in n and len(s) == 3 else "f32")


def _randomise(model: torch.nn.Module, pattern: str, offset: float) -> None:
    """Parameters that start at 0 or 1 (norms, scales, biases), made random around ``offset``."""
    import re

    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(pattern, name):
                p.copy_(torch.randn_like(p) * 0.3 + offset)
        for name, b in model.named_buffers():
            if re.search(pattern, name):
                b.copy_(torch.randn_like(b) * 0.3 + offset)


def _randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 0 or 1; random ones catch a mixed-up norm."""
    offset = 0.0 if "gemma" in type(model).__name__.lower() else 1.0  # Gemma scales by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.3 + offset)
