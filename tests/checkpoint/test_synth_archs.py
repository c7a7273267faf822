"""Synthetic presets in the GPT-OSS and Gemma-4 architectures: real geometry in the plan, and a
tiny-geometry GGUF of each that the gguf package reads as llama.cpp's, that ``transformers``
runs (on the gguf package's dequantisation of its weights) with our logits, and that
generates."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.names import gguf_to_ours
from freetoken.checkpoint.synth import (
    PRESETS,
    SynthSpec,
    hf_config,
    parse_expert_formats,
    plan_bytes,
    resolve_spec,
    tensor_plans,
    write_synth,
)
from freetoken.config import CacheSizing, ModelConfig
from freetoken.errors import ConfigError
from freetoken.quant import get_format
from tests.models.helpers import hf_logits, load_ours, our_greedy, our_logits

IDS = [5, 300, 41, 270, 99, 1, 400, 256, 12, 77, 77, 310, 508, 3, 64, 290]
TINY = {
    "gpt-oss-20b": dict(hidden=64, moe_intermediate=64, experts=8, layers=4, heads=4,
                        kv_heads=2, head_dim=16, vocab=512, sliding_window=6),
    "gemma4-26b-a4b": dict(hidden=64, moe_intermediate=32, experts=8, layers=6, heads=4,
                           kv_heads=2, head_dim=16, full_head_dim=32, full_kv_heads=1,
                           intermediate=96, vocab=512, sliding_window=6),
}
TINY["gemma4-26b-a4b-mxfp4"] = TINY["gemma4-26b-a4b"]
TINY["gemma4-26b-a4b-nvfp4"] = TINY["gemma4-26b-a4b"] | dict(moe_intermediate=64)  # GGUF: 64s
ARCH = {"gpt_oss": "gpt-oss", "gemma4": "gemma4"}


def _tiny(name: str, tmp_path: Path) -> tuple[SynthSpec, Path]:
    p = replace(PRESETS[name], **TINY[name])
    spec = SynthSpec(p, parse_expert_formats(p.expert_format, p.layers), 0.5, 0.5, 1)
    return spec, write_synth(spec, tmp_path / f"{name}.gguf")


def _gguf_dequantised(spec: SynthSpec, gguf: Path) -> dict[str, torch.Tensor]:
    """Every tensor we read, under our name, as the gguf package decodes it."""
    out = {}
    for t in GGUFReader(gguf).tensors:
        name = gguf_to_ours(t.name, spec.preset.family)
        if name is not None:
            values = dequantize(t.data, t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))
            out[name] = torch.from_numpy(values.astype("float32").reshape(shape))
    return out


def _as_hf_dir(spec: SynthSpec, gguf: Path, out: Path) -> Path:
    """The GGUF's weights, dequantised by the gguf package, under transformers' names and
    layouts; our reader's dequantisation of each is the same values."""
    ours = _gguf_dequantised(spec, gguf)
    for name, qt in open_checkpoint(gguf).tensors():
        torch.testing.assert_close(get_format(qt.fmt).dequantize(qt), ours[name], atol=0,
                                   rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    hf: dict[str, torch.Tensor] = {}
    for name, t in ours.items():
        stem, _, proj = name.rpartition(".experts.")
        if spec.preset.family == "gpt_oss" and stem:
            if proj.startswith("gate_proj"):  # gate and up interleave, (E, H, 2I) / (E, 2I)
                up = ours[name.replace("gate_proj", "up_proj")]
                both = torch.stack([t, up], dim=2).flatten(1, 2)
                hf[f"{stem}.experts.gate_up_proj{proj.removeprefix('gate_proj')}"] = \
                    both if proj.endswith("bias") else both.transpose(1, 2)
            elif proj.startswith("down_proj"):
                hf[name] = t if proj.endswith("bias") else t.transpose(1, 2)
            continue
        hf[name] = t
    out.mkdir()
    save_file({n: t.contiguous() for n, t in hf.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(spec)))
    return out


def test_presets_have_the_real_architectures():
    oss = resolve_spec("gpt-oss-20b", gguf=True)
    cfg = ModelConfig.from_hf(hf_config(oss))
    assert cfg.family == "gpt_oss" and oss.expert_formats == ("mxfp4",) * 24
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k,
            cfg.num_layers, cfg.sliding_window) == (2880, 2880, 32, 4, 24, 128)
    assert cfg.sliding_layers == (True, False) * 12 and cfg.expert_bias
    assert 11.5e9 < sum(map(plan_bytes, tensor_plans(oss, True))) < 12.5e9  # MXFP4 GGUF: 12.1 GB
    gemma = resolve_spec("gemma4-26b-a4b", gguf=True)
    cfg = ModelConfig.from_hf(hf_config(gemma))
    assert cfg.family == "gemma4" and gemma.expert_formats == ("q8_0",) * 29 + ("bf16",)
    assert sum(not s for s in cfg.sliding_layers) == 5 and not cfg.sliding_layers[-1]
    assert (cfg.head_dim_of(0), cfg.head_dim_of(5), cfg.kv_heads_of(5)) == (256, 512, 2)
    assert cfg.attention_k_eq_v and cfg.tie_word_embeddings
    mx = resolve_spec("gemma4-26b-a4b-mxfp4", gguf=True)
    assert mx.expert_formats == ("mxfp4",) * 30 and mx.matrix_format == "q8_0"
    assert hf_config(mx) | {"freetoken_synth": None} == hf_config(gemma) | {
        "freetoken_synth": None}  # the same model, its experts in another format
    assert sum(map(plan_bytes, tensor_plans(mx, True))) < 0.6 * sum(
        map(plan_bytes, tensor_plans(gemma, True)))
    nv = resolve_spec("gemma4-26b-a4b-nvfp4", gguf=True)
    assert nv.expert_formats == ("nvfp4",) * 30 and nv.matrix_format == "q8_0"
    assert hf_config(nv) | {"freetoken_synth": None} == hf_config(gemma) | {
        "freetoken_synth": None}
    nv_bytes, mx_bytes = (sum(map(plan_bytes, tensor_plans(s, True))) for s in (nv, mx))
    assert mx_bytes < nv_bytes < 0.65 * sum(map(plan_bytes, tensor_plans(gemma, True)))
    with pytest.raises(ConfigError, match="fp8_block has no GGUF encoding here"):
        resolve_spec("gemma4-26b-a4b", gguf=True, expert_format="fp8_block")
    with pytest.raises(ConfigError, match="GGUF only; pass --out PATH.gguf"):
        resolve_spec("gpt-oss-20b", gguf=False, expert_format="bf16")


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_gguf_is_llamacpps_and_runs_as_transformers(name, tmp_path):
    spec, gguf = _tiny(name, tmp_path)
    r = GGUFReader(gguf)
    assert r.fields["general.architecture"].contents() == ARCH[spec.preset.family]
    types = {t.name: t.tensor_type for t in r.tensors}
    last = spec.preset.layers - 1
    if name == "gpt-oss-20b":
        assert types["blk.0.ffn_gate_exps.weight"] == GGMLQuantizationType.MXFP4
        assert {"blk.0.attn_sinks.weight", "blk.0.ffn_gate_exps.bias"} <= set(types)
    elif name in ("gemma4-26b-a4b-mxfp4", "gemma4-26b-a4b-nvfp4"):
        want = GGMLQuantizationType.MXFP4 if name.endswith("mxfp4") else GGMLQuantizationType.NVFP4
        for i in range(spec.preset.layers):
            for proj in ("gate_up", "down"):
                assert types[f"blk.{i}.ffn_{proj}_exps.weight"] == want
        assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q8_0
    else:
        assert types["blk.0.ffn_gate_up_exps.weight"] == GGMLQuantizationType.Q8_0
        assert types[f"blk.{last}.ffn_gate_up_exps.weight"] == GGMLQuantizationType.BF16
    if spec.preset.family == "gemma4":
        assert f"blk.{last}.attn_v.weight" not in types  # full layers: v from k
    ref = hf_logits(_as_hf_dir(spec, gguf, tmp_path / "hf"), IDS)
    got = our_logits(load_ours(gguf), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert ref.std() > 0.1 and torch.isfinite(ref).all()
    tokens = our_greedy(load_ours(gguf), IDS[:4], 12)
    assert len(tokens) == 12 and all(0 <= t < spec.preset.vocab for t in tokens)


@pytest.mark.parametrize("strategy", ["offload", "cpu"])
def test_nvfp4_gguf_serves_with_residents_tokens(strategy, tmp_path):
    """GGUF NVFP4 experts repacked at load reach the expert cache and the CPU kernels."""
    _, gguf = _tiny("gemma4-26b-a4b-nvfp4", tmp_path)
    experts = {n: qt for n, qt in open_checkpoint(gguf).tensors() if ".experts." in n}
    assert {qt.fmt for qt in experts.values()} == {"nvfp4"} and len(experts) == 2 * 6
    resident = our_greedy(load_ours(gguf), IDS[:6], 16)
    cache = CacheSizing("size", 3) if strategy == "offload" else None
    assert our_greedy(load_ours(gguf, strategy=strategy, cache=cache), IDS[:6], 16) == resident


def test_sampled_gemma4_does_not_repeat_its_input(tmp_path):
    """Gemma-4's head is its embedding, and the residual stream keeps the input token's own:
    unscaled, that token's logit stands far above the rest and a model sampled at
    temperature 1 repeats it for ever (routing the same experts every step). The synthetic
    final norm leaves it a few nats above: sampled, a token repeats its input rarely."""
    _, gguf = _tiny("gemma4-26b-a4b", tmp_path)
    probs = torch.softmax(our_logits(load_ours(gguf), IDS, prefill=len(IDS)), dim=-1)
    repeat = probs[torch.arange(len(IDS)), torch.tensor(IDS)]
    assert float(repeat.mean()) < 0.05, repeat  # 0.11 at unit scale, at this small H
    assert int(probs.argmax(-1).eq(torch.tensor(IDS)).sum()) >= len(IDS) - 2  # greedy still
