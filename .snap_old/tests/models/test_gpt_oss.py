"""GPT-OSS (sinks, yarn rope, sliding and full layers, biased experts with the clamped SwiGLU)
against ``transformers`` on a tiny random checkpoint: HF directory, the same weights as a
llama.cpp-style GGUF, greedy decoding, offload and what auto picks (the CPU kernels:
test_gpt_oss_native.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing, EngineConfig
from freetoken.errors import ConfigError
from freetoken.moe.plan import plan_moe
from tests.models.helpers import (
    hf_greedy,
    hf_logits,
    load_ours,
    our_greedy,
    our_logits,
    skip_where_hf_ignores_the_clamp,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


def _gguf(src, out, experts: str = "f32"):
    return convert_to_gguf(open_checkpoint(src), out,
                           lambda n, s: experts if ".experts." in n and len(s) == 3 else "f32")


@pytest.mark.parametrize("device", DEVICES)
def test_matches_transformers_across_the_window(tiny_gpt_oss, device):
    ref = hf_logits(tiny_gpt_oss, IDS)
    ours = our_logits(load_ours(tiny_gpt_oss, device=device), IDS, prefill=9, device=device)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_gives_the_cpus_logits(tiny_gpt_oss):
    """Our GPU run against our CPU run, which the tests here hold to ``transformers``: where
    the installed ``transformers`` cannot be the reference, the GPU's path is still held."""
    cpu = our_logits(load_ours(tiny_gpt_oss), IDS, prefill=9)
    gpu = our_logits(load_ours(tiny_gpt_oss, device="cuda"), IDS, prefill=9, device="cuda")
    torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-4)


def test_the_clamp_and_the_sinks_matter(tiny_gpt_oss):
    """Guards the parity test: without the clamp or the sinks the logits move well past its
    tolerance, so neither can be silently dropped."""
    ref = hf_logits(tiny_gpt_oss, IDS)
    model = load_ours(tiny_gpt_oss)
    base = our_logits(model, IDS, prefill=9)
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert (our_logits(model, IDS, prefill=9) - ref).abs().max() > 1e-3  # 10x the tolerance
    model = load_ours(tiny_gpt_oss)
    for layer in model.model.layers:
        layer.mlp.experts.act.limit = 1e9
    assert (our_logits(model, IDS, prefill=9) - ref).abs().max() > 1e-3  # 10x the tolerance
    torch.testing.assert_close(base, ref, atol=1e-4, rtol=1e-4)


def test_gguf_has_llamacpps_names_and_keys(tiny_gpt_oss, tmp_path):
    from gguf import GGUFReader

    r = GGUFReader(_gguf(tiny_gpt_oss, tmp_path / "m.gguf"))
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in r.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (64, 32, 8)  # ggml order: H, I, E
    assert shapes["blk.0.ffn_down_exps.weight"] == (32, 64, 8)
    assert shapes["blk.0.ffn_gate_exps.bias"] == (32, 8)
    assert shapes["blk.0.attn_sinks.weight"] == (4,)
    assert {"blk.0.ffn_gate_inp.bias", "blk.0.attn_q.bias", "blk.0.post_attention_norm.weight",
            "blk.0.ffn_up_exps.bias", "blk.0.ffn_down_exps.bias"} <= set(shapes)
    f = r.fields
    assert f["general.architecture"].contents() == "gpt-oss"
    assert f["gpt-oss.rope.scaling.type"].contents() == "yarn"
    assert f["gpt-oss.rope.scaling.original_context_length"].contents() == 32
    assert f["gpt-oss.expert_feed_forward_length"].contents() == 32


@pytest.mark.parametrize("device", DEVICES)
def test_f32_gguf_matches_transformers(tiny_gpt_oss, tmp_path, device):
    out = _gguf(tiny_gpt_oss, tmp_path / "m.gguf")
    ref = hf_logits(tiny_gpt_oss, IDS)
    got = our_logits(load_ours(out, device=device), IDS, prefill=5, device=device)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_q8_0_experts_match_transformers_on_the_same_blocks(tiny_gpt_oss, tmp_path):
    from transformers import AutoModelForCausalLM

    skip_where_hf_ignores_the_clamp(tiny_gpt_oss)
    out = _gguf(tiny_gpt_oss, tmp_path / "m.gguf", "q8_0")
    hf = AutoModelForCausalLM.from_pretrained(tiny_gpt_oss, dtype=torch.float32).eval()
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # transformers keeps them (E, in, out): GGUF's blocks run along ``in``
                w = p.detach().transpose(1, 2).contiguous().numpy()
                q = dequantize(quantize(w, q8), q8).reshape(w.shape)
                p.copy_(torch.from_numpy(q).transpose(1, 2))
        ref = hf(torch.tensor([IDS])).logits[0]
    got = our_logits(load_ours(out), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, hf_logits(tiny_gpt_oss, IDS), atol=1e-6)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_equal_transformers(tiny_gpt_oss, tmp_path, source):
    path = tiny_gpt_oss if source == "hf" else _gguf(tiny_gpt_oss, tmp_path / "m.gguf")
    want = hf_greedy(tiny_gpt_oss, IDS[:6], 32)
    assert our_greedy(load_ours(path), IDS[:6], 32) == want


def test_offload_gives_residents_tokens(tiny_gpt_oss, tmp_path):
    out = _gguf(tiny_gpt_oss, tmp_path / "m.gguf", "q8_0")
    resident = our_greedy(load_ours(out), IDS[:6], 32)
    offload = our_greedy(load_ours(out, strategy="offload", cache=CacheSizing("size", 3)),
                         IDS[:6], 32)
    assert offload == resident


def test_auto_runs_the_cpu_kernels(tiny_gpt_oss):
    from freetoken.cpu import executor as cx

    if (why := cx.available()) is not None:
        pytest.skip(why)
    cfg = EngineConfig(model=str(tiny_gpt_oss), device="cpu", dtype="float32",
                       moe_strategy="auto", max_seq_len=64)
    plan = plan_moe(cfg, open_checkpoint(tiny_gpt_oss), torch.device("cpu"))
    assert set(plan.strategies) == {"cpu"} and plan.needs.cpu_pool


def test_a_clamp_the_kernels_cannot_take_keeps_auto_off_them(tiny_gpt_oss, tmp_path, caplog):
    bad = tmp_path / "m"
    shutil.copytree(tiny_gpt_oss, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["swiglu_limit"] = 0.0
    (bad / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(bad)
    with caplog.at_level("INFO"):
        plan = plan_moe(EngineConfig(model=str(bad), device="cpu", dtype="float32",
                                     moe_strategy="auto", max_seq_len=64), ckpt,
                        torch.device("cpu"))
    assert set(plan.strategies) == {"resident"} and not plan.needs.cpu_pool
    with pytest.raises(ConfigError, match="--moe-strategy cpu cannot run gpt_oss's experts: "
                                          "the clamped SwiGLU needs a positive alpha and limit"):
        plan_moe(EngineConfig(model=str(bad), device="cpu", dtype="float32",
                              moe_strategy="cpu", max_seq_len=64), ckpt, torch.device("cpu"))
