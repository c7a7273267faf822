"""Synthetic checkpoints: real-geometry presets, HF and GGUF output, tokenizer, router knobs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.synth import (
    QWEN2_SPLIT,
    Weights,
    hf_config,
    parse_expert_formats,
    plan_bytes,
    resolve_spec,
    tensor_plans,
    write_synth,
)
from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.engine import Engine
from freetoken.errors import ConfigError
from freetoken.models.blocks import MoEBlock
from freetoken.models.qwen3_moe import Qwen3MoeDecoderLayer
from tests.models.helpers import hf_logits, load_ours, our_logits

IDS = [5, 300, 41, 270, 99, 1, 400, 256, 12, 77, 77, 310, 508, 3, 64, 290]


@pytest.fixture(autouse=True)
def _isolate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A private tokenizer cache; one torch thread (tiny models, shared cores)."""
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = resolve_spec("tiny", gguf=False, router_skew=0.5, router_locality=0.5, seed=3)
    # a small shard size forces several shards and an index
    return write_synth(spec, tmp_path_factory.mktemp("synth") / "tiny", shard_bytes=40_000)


def test_presets_have_real_geometry():
    full = resolve_spec("qwen3-30b-a3b", gguf=False)
    size = sum(map(plan_bytes, tensor_plans(full, stacked=False)))
    assert 60e9 < size < 62e9  # Qwen3-30B-A3B in bf16 is 61 GB
    cfg = ModelConfig.from_hf(hf_config(full))
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k,
            cfg.num_layers, cfg.vocab_size) == (2048, 768, 128, 8, 48, 151936)
    gemma = resolve_spec("gemma4-26b-a4b", gguf=True)
    assert gemma.expert_formats == ("q8_0",) * 29 + ("bf16",)
    assert gemma.matrix_format == "q8_0"
    assert resolve_spec("gemma4-26b-a4b", gguf=True, layers=4).expert_formats[-2:] == (
        "q8_0", "bf16")
    oss = resolve_spec("gpt-oss-20b", gguf=True, layers=2, experts=4)
    assert oss.expert_formats == ("mxfp4", "mxfp4") and oss.preset.moe_intermediate == 2880


def test_expert_format_spec():
    assert parse_expert_formats("q8_0", 3) == ("q8_0",) * 3
    assert parse_expert_formats("q8_0*2,bf16", 3) == ("q8_0", "q8_0", "bf16")
    assert parse_expert_formats("bf16,q8_0*", 3) == ("bf16", "q8_0", "q8_0")
    assert parse_expert_formats("q8_0,mxfp4,bf16", 3) == ("q8_0", "mxfp4", "bf16")
    for bad, needle in [("q9_0", "unknown expert format"), ("q8_0*2", "gives 2 layer"),
                        ("q8_0,bf16", "gives 2 layer"), ("q8_0*,bf16*", "plus a fill"),
                        ("q8_0*x", "bad repeat count"),
                        ("fp8_block", "fp8_block has no GGUF encoding here")]:
        with pytest.raises(ConfigError, match=needle):
            parse_expert_formats(bad, 3)


def test_bad_combinations_name_the_fix(tmp_path: Path):
    with pytest.raises(ConfigError, match="Hugging Face directory.*--expert-format bf16"):
        resolve_spec("qwen3-30b-a3b", gguf=False, expert_format="mxfp4")
    with pytest.raises(ConfigError, match="multiple of 256"):
        resolve_spec("gemma4-26b-a4b", gguf=True, expert_format="q4_k")
    with pytest.raises(ConfigError, match="--experts 2 or more"):
        resolve_spec("tiny", gguf=True, experts=1)
    with pytest.raises(ConfigError, match="--vocab"):
        resolve_spec("tiny", gguf=True, vocab=100)
    with pytest.raises(ConfigError, match="--router-locality"):
        resolve_spec("tiny", gguf=True, router_locality=1.5)
    with pytest.raises(ConfigError, match="unknown --preset"):
        resolve_spec("llama", gguf=True)
    out = tmp_path / "x.gguf"
    out.write_bytes(b"")
    with pytest.raises(ConfigError, match="--overwrite"):
        write_synth(resolve_spec("tiny", gguf=True), out)


def test_hf_dir_loads_in_transformers_with_our_logits(tiny_hf: Path):
    files = sorted(p.name for p in tiny_hf.glob("*.safetensors"))
    assert len(files) > 1 and (tiny_hf / "model.safetensors.index.json").exists()
    index = json.loads((tiny_hf / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]
    ref = hf_logits(tiny_hf, IDS)  # transformers, float32 from the bf16 weights
    ours = our_logits(load_ours(tiny_hf), IDS, prefill=5)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    assert ref.std() > 0.1  # not a degenerate model


def test_gguf_per_layer_formats_and_same_weights_as_hf(tmp_path: Path, tiny_hf: Path):
    spec = resolve_spec("tiny", gguf=True, expert_format="q8_0,bf16", router_skew=0.5,
                        router_locality=0.5, seed=3)
    ckpt = open_checkpoint(write_synth(spec, tmp_path / "mixed.gguf"))
    fmts = {name: t.fmt for name, t in ckpt.tensors()}
    assert fmts["model.layers.0.mlp.experts.gate_proj"] == "q8_0"
    assert fmts["model.layers.0.mlp.experts.down_proj"] == "q8_0"
    assert fmts["model.layers.1.mlp.experts.up_proj"] == "bf16"
    assert fmts["model.layers.0.mlp.gate.weight"] == "f32"
    assert fmts["model.layers.1.self_attn.q_proj.weight"] == "bf16"  # half the layers: bf16
    hf_cfg = open_checkpoint(tiny_hf).config
    # rms_norm_eps is f32 in GGUF; a GGUF also stops at its vocabulary's end-of-turn tokens
    assert ckpt.config == replace(hf_cfg, rms_norm_eps=ckpt.config.rms_norm_eps,
                                  eos_token_ids=ckpt.config.eos_token_ids)
    assert ckpt.config.eos_token_ids == (*hf_cfg.eos_token_ids, spec.preset.vocab - 3)
    # all-bf16 GGUF of the same seed holds exactly the HF directory's weights
    bf16 = write_synth(resolve_spec("tiny", gguf=True, router_skew=0.5, router_locality=0.5,
                                    seed=3), tmp_path / "bf16.gguf")
    torch.testing.assert_close(our_logits(load_ours(bf16), IDS, prefill=5),
                               our_logits(load_ours(tiny_hf), IDS, prefill=5), atol=0, rtol=0)
    quant = our_logits(load_ours(ckpt.path), IDS, prefill=5)
    assert (quant - our_logits(load_ours(bf16), IDS, prefill=5)).abs().max() < 0.1


def test_tokenizers_agree_between_hf_and_gguf(tmp_path: Path, tiny_hf: Path):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_SPLIT == PRETOKENIZE_REGEX
    gguf = write_synth(resolve_spec("tiny", gguf=True), tmp_path / "t.gguf")
    hf_tok, gguf_tok = open_checkpoint(tiny_hf).tokenizer(), open_checkpoint(gguf).tokenizer()
    text = "the cat sat, on 3 Mats!\n<|im_end|>"
    ids = hf_tok(text).input_ids
    assert ids == gguf_tok(text).input_ids
    assert ids[-1] == 511 and len(ids) < len(text.encode()) - 12  # specials, merged words
    assert hf_tok.decode(ids) == gguf_tok.decode(ids) == text
    assert open_checkpoint(gguf).chat_template and open_checkpoint(tiny_hf).chat_template


def test_same_seed_same_bytes(tmp_path: Path):
    spec = resolve_spec("tiny", gguf=True, expert_format="q8_0", seed=7)
    a = write_synth(spec, tmp_path / "a.gguf").read_bytes()
    assert a == write_synth(spec, tmp_path / "b.gguf").read_bytes()
    other = resolve_spec("tiny", gguf=True, expert_format="q8_0", seed=8)
    assert a != write_synth(other, tmp_path / "c.gguf").read_bytes()


def _routing(path: Path, tokens: int = 96) -> list[torch.Tensor]:
    """Top-k expert ids (T, A) of every MoE layer for one prefill of random tokens."""
    engine = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 moe_strategy="resident", max_seq_len=tokens), progress=False)
    seen: list[torch.Tensor] = []
    for block in engine.model.modules():
        if isinstance(block, MoEBlock):
            def route(x: torch.Tensor, _route=block.route) -> tuple[torch.Tensor, torch.Tensor]:
                ids, weights = _route(x)
                seen.append(ids)
                return ids, weights
            block.route = route  # type: ignore[method-assign]
    ids = torch.randint(0, 500, (tokens,), generator=torch.Generator().manual_seed(0))
    engine.forward(ids.tolist(), 0)
    for block in engine.model.modules():
        if isinstance(block, MoEBlock):
            del block.route  # the wrapper closes over its block: break the cycle
    return seen


def _synth_routing(tmp_path: Path, name: str, skew: float = 0.0,
                   locality: float = 0.0) -> list[torch.Tensor]:
    spec = resolve_spec("tiny", gguf=False, experts=32, layers=3, router_skew=skew,
                        router_locality=locality)
    return _routing(write_synth(spec, tmp_path / name))


def test_router_skew_concentrates_expert_use(tmp_path: Path):
    def top_quarter_share(layers: list[torch.Tensor]) -> float:
        shares = []
        for ids in layers:
            counts = torch.bincount(ids.flatten(), minlength=32).sort(descending=True).values
            shares.append(float(counts[:8].sum() / counts.sum()))
        return min(shares)

    uniform = top_quarter_share(_synth_routing(tmp_path, "u"))
    skewed = top_quarter_share(_synth_routing(tmp_path, "s", skew=1.0))
    assert uniform < 0.5 and skewed > 0.65, (uniform, skewed)


def test_router_locality_makes_consecutive_tokens_share_experts(tmp_path: Path):
    def overlap(layers: list[torch.Tensor]) -> float:
        shared = []
        for ids in layers:
            a, b = ids[16:-1], ids[17:]  # past the first window
            shared.append(float((a[:, :, None] == b[:, None, :]).any(-1).float().mean()))
        return min(shared)

    independent = overlap(_synth_routing(tmp_path, "i"))
    local = overlap(_synth_routing(tmp_path, "l", locality=0.9))
    assert independent < 0.2 and local > 0.5, (independent, local)


def test_48_layers_stay_finite_and_order_one(tmp_path: Path):
    spec = resolve_spec("tiny", gguf=False, layers=48, router_skew=0.5, router_locality=0.5)
    model = load_ours(write_synth(spec, tmp_path / "deep"))
    rms: list[float] = []
    for layer in model.modules():
        if isinstance(layer, Qwen3MoeDecoderLayer):
            # a layer returns its residual and its output apart: the stream is their sum
            layer.register_forward_hook(lambda m, a, y: rms.append(
                float((y[0] if y[1] is None else y[0] + y[1]).pow(2).mean().sqrt())))
    logits = our_logits(model, IDS, prefill=8)
    assert torch.isfinite(logits).all() and len(rms) == 48 * 9
    assert 0.5 < min(rms) and max(rms) < 4.0, (min(rms), max(rms))


def test_weights_are_exact_in_bf16_and_scaled():
    spec = resolve_spec("tiny", gguf=True, layers=8)
    w = Weights(spec)
    down = w.make("model.layers.3.mlp.experts.down_proj")
    assert down.shape == (8, 64, 32) and down.dtype == torch.bfloat16
    assert torch.equal(down[2], w.make("model.layers.3.mlp.experts.2.down_proj.weight"))
    gate = w.make("model.layers.3.mlp.experts.5.gate_proj.weight")
    assert 0.8 < float(gate.std() * 64 ** 0.5 * (64 / 63) ** 0.5) < 1.2  # ~1/sqrt(fan_in)


def test_cli_writes_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture):
    from freetoken.cli import main

    out = tmp_path / "m.gguf"
    args = ["synth", "--preset", "tiny", "--out", str(out), "--expert-format", "q8_0*,bf16"]
    assert main(args) == 0
    assert str(out) in capsys.readouterr().out
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite", "--layers", "3"]) == 0
    assert open_checkpoint(out).config.num_layers == 3
    assert main(["synth", "--preset", "tiny", "--out", str(tmp_path / "d"),
                 "--expert-format", "mxfp4"]) == 2
    assert "--expert-format bf16" in capsys.readouterr().err
