"""Our Qwen3-MoE and Gemma-3 against ``transformers`` on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import hf_logits, load_ours, our_logits

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_moe_matches_transformers(tiny_qwen3_moe, device):
    ref = hf_logits(tiny_qwen3_moe, IDS)
    ours = our_logits(load_ours(tiny_qwen3_moe, device=device), IDS, prefill=6, device=device)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_gemma3_matches_transformers_across_the_window(tiny_gemma3, device):
    # 16 tokens with a window of 5: sliding layers must forget, the global layer must not
    ref = hf_logits(tiny_gemma3, IDS)
    ours = our_logits(load_ours(tiny_gemma3, device=device), IDS, prefill=9, device=device)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compute_stays_close(tiny_qwen3_moe, device):
    ref = hf_logits(tiny_qwen3_moe, IDS)
    ours = our_logits(load_ours(tiny_qwen3_moe, dtype=torch.bfloat16, device=device), IDS,
                      prefill=6, device=device)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
