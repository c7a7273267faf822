"""The same weights written as GGUF load into the same model.

bf16 experts: our GGUF load equals our HF load. q8_0 experts: the reference is ``transformers``
with its expert weights replaced by the ``gguf`` package's dequantisation of the q8_0 blocks, so
the check is tight.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from tests.models.helpers import load_ours, our_logits

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


def _formats(expert_fmt: str):
    def pick(name: str, shape: tuple[int, ...]) -> str:
        if ".mlp.experts." in name:
            return expert_fmt
        return "f32"
    return pick


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_gemma3"])
def test_f32_gguf_equals_hf_load(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    out = convert_to_gguf(open_checkpoint(src), tmp_path / "m.gguf", _formats("f32"))
    ref = our_logits(load_ours(src), IDS, prefill=5)
    got = our_logits(load_ours(out), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bf16_experts_gguf(tiny_qwen3_moe, tmp_path):
    out = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "m.gguf", _formats("bf16"))
    ckpt = open_checkpoint(out)
    fmts = {n: q.fmt for n, q in ckpt.tensors() if ".experts." in n}
    assert set(fmts.values()) == {"bf16"} and len(fmts) == 6  # 2 MoE layers x 3 tensors
    ref = our_logits(load_ours(tiny_qwen3_moe), IDS, prefill=5)
    got = our_logits(load_ours(out), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("device", DEVICES)
def test_q8_0_experts_match_transformers_on_the_same_blocks(tiny_qwen3_moe, tmp_path, device):
    from transformers import AutoModelForCausalLM

    out = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "m.gguf", _formats("q8_0"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.float32).eval()
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".mlp.experts." in name:  # transformers keeps experts fused: (E, 2I, H), (E, H, I)
                w = p.detach().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(w, q8), q8).reshape(w.shape)))
        ref = hf(torch.tensor([IDS])).logits[0]
    got = our_logits(load_ours(out, device=device), IDS, prefill=5, device=device)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not np.allclose(ref.numpy(), our_logits(load_ours(tiny_qwen3_moe), IDS, 5).numpy(),
                           atol=1e-6), "q8_0 should change the logits a little"
