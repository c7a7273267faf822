"""Gemma-4 (MoE, sliding and full layers of their own geometry) against ``transformers`` on a
tiny random checkpoint: HF directory, the same weights as a llama.cpp-style GGUF (f32 and
q8_0 experts), greedy decoding, every MoE strategy."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.errors import CheckpointError
from tests.models.helpers import hf_greedy, hf_logits, load_ours, our_greedy, our_logits

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


def _gguf(src, out, experts: str = "f32"):
    return convert_to_gguf(open_checkpoint(src), out,
                           lambda n, s: experts if ".experts." in n else "f32")


@pytest.mark.parametrize("device", DEVICES)
def test_matches_transformers_across_the_window(tiny_gemma4, device):
    # 16 tokens, window 5: sliding layers forget, full layers (head 32, v = k) do not
    ref = hf_logits(tiny_gemma4, IDS)
    ours = our_logits(load_ours(tiny_gemma4, device=device), IDS, prefill=9, device=device)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_gguf_has_llamacpps_names_and_keys(tiny_gemma4, tmp_path):
    from gguf import GGUFReader

    r = GGUFReader(_gguf(tiny_gemma4, tmp_path / "m.gguf"))
    names = {t.name for t in r.tensors}
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_down_exps.weight",
            "blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale", "blk.0.pre_ffw_norm_2.weight",
            "blk.0.post_ffw_norm_1.weight", "blk.0.layer_output_scale.weight",
            "rope_freqs.weight", "blk.0.attn_v.weight"} <= names
    assert "blk.2.attn_v.weight" not in names  # full layer: v comes from k's projection
    f = r.fields
    assert f["general.architecture"].contents() == "gemma4"
    assert f["gemma4.attention.key_length"].contents() == 32
    assert f["gemma4.attention.key_length_swa"].contents() == 16
    assert f["gemma4.attention.sliding_window_pattern"].contents() == [
        True, True, False, True, True, False]
    assert f["gemma4.attention.head_count_kv"].contents() == [2, 2, 1, 2, 2, 1]
    freqs = r.get_tensor([t.name for t in r.tensors].index("rope_freqs.weight")).data
    assert freqs.tolist() == [1.0] * 4 + [float(np.float32(1e30))] * 12  # 4 of 16 pairs turn


@pytest.mark.parametrize("device", DEVICES)
def test_f32_gguf_matches_transformers(tiny_gemma4, tmp_path, device):
    out = _gguf(tiny_gemma4, tmp_path / "m.gguf")
    ref = hf_logits(tiny_gemma4, IDS)
    got = our_logits(load_ours(out, device=device), IDS, prefill=5, device=device)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_q8_0_experts_match_transformers_on_the_same_blocks(tiny_gemma4, tmp_path):
    from transformers import AutoModelForCausalLM

    out = _gguf(tiny_gemma4, tmp_path / "m.gguf", "q8_0")
    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma4, dtype=torch.float32).eval()
    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name:  # (E, 2I, H) and (E, H, I): blocks run along the last axis
                w = p.detach().numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(w, q8), q8).reshape(w.shape)))
        ref = hf(torch.tensor([IDS])).logits[0]
    got = our_logits(load_ours(out), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, hf_logits(tiny_gemma4, IDS), atol=1e-6)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_equal_transformers(tiny_gemma4, tmp_path, source):
    path = tiny_gemma4 if source == "hf" else _gguf(tiny_gemma4, tmp_path / "m.gguf")
    want = hf_greedy(tiny_gemma4, IDS[:6], 32)
    assert our_greedy(load_ours(path), IDS[:6], 32) == want


def test_offload_gives_residents_tokens(tiny_gemma4):
    resident = our_greedy(load_ours(tiny_gemma4), IDS[:6], 32)
    # 3 slots per layer for 8 experts: misses, evictions and streamed prefill all happen
    offload = our_greedy(load_ours(tiny_gemma4, strategy="offload", cache=CacheSizing("size", 3)),
                         IDS[:6], 32)
    assert offload == resident


@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
def test_native_strategies_give_residents_tokens(tiny_gemma4, tmp_path, monkeypatch, strategy):
    from freetoken.cpu import executor as cx

    if (why := cx.available()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    # bf16 experts: the kernels round activations to bf16 (q8_0 ones to int8, which the norm
    # after Gemma-4's experts scales up to token flips on tiny random weights). The logits of
    # this model span under 1 and half its greedy steps are near-ties (top-2 margins down to
    # 0.002), so tokens are compared where the rounding cannot reach: on resident's own
    # continuation, every step whose margin is over twice the logits' tolerance
    out = _gguf(tiny_gemma4, tmp_path / "m.gguf", "bf16")
    resident = load_ours(out)
    want = our_greedy(resident, IDS[:6], 32)
    ref = our_logits(resident, IDS[:6] + want, prefill=6)
    # the split held fixed: moved online it follows measured times (the tokens of two runs
    # could part at a near-tie)
    other = load_ours(out, strategy=strategy, cache=CacheSizing("size", 3), max_fetch=1,
                      online=False)
    got = our_logits(other, IDS[:6] + want, prefill=6)
    tol = 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=0)
    top2 = ref[5:-1].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert clear.sum() >= 8  # the check reaches a fair share of the 32 steps
    assert got[5:-1].argmax(-1)[clear].tolist() == torch.tensor(want)[clear].tolist()
    # and the same request gives the same tokens again
    assert our_greedy(other, IDS[:6], 32) == our_greedy(other, IDS[:6], 32)


# experts of three formats, two layers each; every format's layers are a pool of the cache
MIXED = ("q8_0", "q8_0", "bf16", "bf16", "mxfp4", "mxfp4")
# relative to the largest output, as tests/cpu/test_kernels.py allows the pool's kernels:
# int8 activations (q8_0, mxfp4) and bf16 ones
AS_SERVED = {"q8_0": 3e-2, "bf16": 2e-2, "mxfp4": 3e-2}


def _mixed_gguf(src, out):
    def fmt(name: str, shape: tuple[int, ...]) -> str:
        m = re.match(r"model\.layers\.(\d+)\.experts\.", name)
        return MIXED[int(m.group(1))] if m else "f32"

    return convert_to_gguf(open_checkpoint(src), out, fmt)


@pytest.mark.parametrize("strategy", ["offload", "cpu", "hybrid"])
def test_mixed_format_experts_serve_with_residents_tokens(tiny_gemma4, tmp_path, monkeypatch,
                                                          strategy):
    """q8_0, bf16 and mxfp4 expert layers in one GGUF. Offload gives resident's logits bit for
    bit. The CPU pool's kernels, with float32 activations, give them to 1e-5 and resident's
    tokens; as the engine runs them (int8 activations for q8_0 and mxfp4, bf16 for bf16) each
    layer's experts stay within the kernels' tolerance of resident's on the same input, a
    rounding the tiny model's next router can turn into another expert, so tokens are compared
    on the float32 run."""
    from gguf import GGUFReader

    from freetoken.cpu import executor as cx

    if strategy != "offload" and (why := cx.available()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    out = _mixed_gguf(tiny_gemma4, tmp_path / "mixed.gguf")
    types = {t.name: t.tensor_type.name.lower() for t in GGUFReader(out).tensors}
    assert [types[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate_up", "down")
            for i in range(6)] == list(MIXED) * 2
    resident = load_ours(out)
    want = our_greedy(resident, IDS[:6], 32)
    ref = our_logits(resident, IDS[:6] + want, prefill=6)
    # 3 slots per pool for 16 experts: misses and evictions in every layer (a pool of fewer
    # slots than the top-k streams every call, and hybrid would never split)
    cache = CacheSizing("size", 9)
    if strategy == "offload":
        other = load_ours(out, strategy=strategy, cache=cache)
        assert torch.equal(our_logits(other, IDS[:6] + want, prefill=6), ref)
        assert our_greedy(other, IDS[:6], 32) == want
        return
    exact = load_ours(out, strategy=strategy, cache=cache, max_fetch=1, online=False, act="f32")
    torch.testing.assert_close(our_logits(exact, IDS[:6] + want, prefill=6), ref, atol=1e-5,
                               rtol=0)
    assert our_greedy(exact, IDS[:6], 32) == want
    served = load_ours(out, strategy=strategy, cache=cache, max_fetch=1, online=False)
    if strategy == "hybrid":  # the online split's costs: one set per expert format
        costs = [layer.experts.policy.costs for layer in served.model.layers]
        assert [c.layers for c in costs] == [2] * 6
        assert len({id(c) for c in costs}) == 3 and costs[0] is costs[1]
    calls: dict[int, list] = {}
    for i, layer in enumerate(served.model.layers):
        layer.experts.register_forward_hook(
            lambda m, args, y, i=i: calls.setdefault(i, []).append((args, y)))
    our_logits(served, IDS[:6] + want, prefill=6)
    for i, layer in enumerate(resident.model.layers):
        for args, y in calls[i]:
            with torch.inference_mode():
                r = layer.experts(*args)
            err = float((y - r).abs().max() / r.abs().max())
            assert err < AS_SERVED[MIXED[i]], f"layer {i} ({MIXED[i]}): {err:.4f}"
    if strategy == "hybrid":  # each layer both fetched misses and computed some on the CPU
        stats = served.model.layers[0].experts.runtime.stats.layers
        assert all(stats[i].misses > 0 and stats[i].cpu_experts > 0 for i in range(6))


def test_per_layer_embeddings_are_refused_by_name(tiny_gemma4, tmp_path):
    bad = tmp_path / "ple"
    shutil.copytree(tiny_gemma4, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size_per_layer_input"] = 256
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="per-layer input embeddings"):
        open_checkpoint(bad)
