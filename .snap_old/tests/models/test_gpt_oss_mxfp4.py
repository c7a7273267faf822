"""GPT-OSS with MXFP4 experts: the official checkpoints' ``*_blocks`` / ``*_scales`` read as
our mxfp4 blocks, and a llama.cpp-style GGUF of the same experts; both checked against
``transformers``' own dequantisation and its model on the dequantised weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.quant import get_format
from tests.models.helpers import load_ours, our_greedy, our_logits, skip_where_hf_ignores_the_clamp

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]
MXFP4 = GGMLQuantizationType.MXFP4
# as openai/gpt-oss-20b's config.json has it
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


@pytest.fixture(scope="module")
def mxfp4_dir(tiny_gpt_oss: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-OSS with its experts replaced by random MXFP4 bits in the official
    layout: ``gate_up_proj_blocks`` (E, 2I, H/32, 16), ``down_proj_blocks`` (E, H, I/32, 16),
    e8m0 ``*_scales`` of one fewer axis (exponents around 2**-7 keep the logits tame)."""
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    for f in tiny_gpt_oss.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for name, t in load_file(tiny_gpt_oss / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t
            continue
        E, cols, rows = t.shape  # transformers keeps them (E, in, out)
        tensors[name + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16),
                                                  dtype=torch.uint8, generator=g)
        tensors[name + "_scales"] = torch.randint(118, 123, (E, rows, cols // 32),
                                                  dtype=torch.uint8, generator=g)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION}))
    return out


def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()


@torch.inference_mode()
def _hf_logits(path: Path) -> torch.Tensor:
    skip_where_hf_ignores_the_clamp(path)
    return _hf_model(path)(torch.tensor([IDS])).logits[0]


def _reference_experts(path: Path, layer: int) -> dict[str, torch.Tensor]:
    """transformers' dequantisation of one layer, in our orientation (E, out, in)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    raw = load_file(path / "model.safetensors")
    stem = f"model.layers.{layer}.mlp.experts."

    def deq(proj: str) -> torch.Tensor:
        return convert_moe_packed_tensors(raw[f"{stem}{proj}_blocks"], raw[f"{stem}{proj}_scales"],
                                          dtype=torch.float32).transpose(1, 2)

    gate_up = deq("gate_up_proj")
    return {"gate_proj": gate_up[:, ::2], "up_proj": gate_up[:, 1::2],
            "down_proj": deq("down_proj")}


def test_blocks_are_read_as_mxfp4_and_dequantise_to_transformers(mxfp4_dir):
    ckpt = open_checkpoint(mxfp4_dir)
    got = {n: qt for n, qt in ckpt.tensors() if ".mlp.experts." in n and "bias" not in n}
    assert len(got) == 3 * ckpt.config.num_layers
    assert "model.layers.0.mlp.experts.gate_proj" in ckpt.tensor_names()
    assert not [n for n in ckpt.tensor_names() if n.endswith(("_blocks", "_scales"))]
    for layer in range(ckpt.config.num_layers):
        for proj, want in _reference_experts(mxfp4_dir, layer).items():
            qt = got[f"model.layers.{layer}.mlp.experts.{proj}"]
            assert qt.fmt == "mxfp4" and qt.shape == tuple(want.shape)
            assert torch.equal(get_format("mxfp4").dequantize(qt), want)
            # the repacked bytes are llama.cpp's blocks: the gguf package reads them alike
            ref = gguf_dequantize(qt.data.numpy(), MXFP4).reshape(want.shape)
            assert torch.equal(torch.from_numpy(np.ascontiguousarray(ref)), want)


def test_tensor_infos_are_the_blocks_as_read(mxfp4_dir):
    """The infos group ``*_blocks`` with ``*_scales`` and split gate from up as reading does."""
    ckpt = open_checkpoint(mxfp4_dir)
    infos = [(t.name, t.fmt, t.shape, t.nbytes) for t in ckpt.tensor_infos()]
    assert infos == [(n, qt.fmt, tuple(qt.shape), qt.nbytes) for n, qt in ckpt.tensors()]
    assert {i[1] for i in infos if i[0].endswith("experts.gate_proj")} == {"mxfp4"}


def test_logits_match_transformers_on_the_dequantised_experts(mxfp4_dir, tiny_gpt_oss):
    ref = _hf_logits(mxfp4_dir)
    got = our_logits(load_ours(mxfp4_dir), IDS, prefill=9)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the experts are the random bits, not the tiny model's own weights
    assert not torch.allclose(got, _hf_logits(tiny_gpt_oss), atol=1e-3)


def test_offload_reads_the_blocks_with_residents_tokens(mxfp4_dir):
    resident = our_greedy(load_ours(mxfp4_dir), IDS[:6], 16)
    offload = our_greedy(load_ours(mxfp4_dir, strategy="offload", cache=CacheSizing("size", 3)),
                         IDS[:6], 16)
    assert offload == resident


def test_mxfp4_gguf_is_llamacpps_blocks_and_matches_transformers(mxfp4_dir, tmp_path):
    out = convert_to_gguf(open_checkpoint(mxfp4_dir), tmp_path / "m.gguf",
                          lambda n, s: "mxfp4" if ".experts." in n and len(s) == 3 else "f32")
    from gguf import GGUFReader

    stored = {t.name: t for t in GGUFReader(out).tensors}
    want = _reference_experts(mxfp4_dir, 1)
    for proj, kind in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        t = stored[f"blk.1.ffn_{kind}_exps.weight"]
        assert t.tensor_type == MXFP4
        # the blocks the gguf package's quantiser writes for transformers' weights
        blocks = gguf_quantize(want[proj].contiguous().numpy(), MXFP4)
        assert np.array_equal(np.asarray(t.data).reshape(blocks.shape), blocks)
    ckpt = open_checkpoint(out)
    assert {qt.fmt for n, qt in ckpt.tensors() if n.endswith("experts.gate_proj")} == {"mxfp4"}
    got = our_logits(load_ours(out), IDS, prefill=5)
    torch.testing.assert_close(got, _hf_logits(mxfp4_dir), atol=1e-4, rtol=1e-4)


def test_scales_in_another_shard(mxfp4_dir, tmp_path):
    for f in mxfp4_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    raw = load_file(mxfp4_dir / "model.safetensors")
    shards: dict[str, dict[str, torch.Tensor]] = {"a.safetensors": {}, "b.safetensors": {}}
    for name, t in raw.items():
        shards["b.safetensors" if name.endswith("_scales") else "a.safetensors"][name] = t
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / file, metadata={"format": "pt"})
    weight_map = {n: file for file, tensors in shards.items() for n in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = dict(open_checkpoint(tmp_path).tensors())["model.layers.0.mlp.experts.down_proj"]
    want = _reference_experts(mxfp4_dir, 0)["down_proj"]
    assert torch.equal(get_format("mxfp4").dequantize(got), want)


@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
def test_cpu_kernels_read_the_hf_blocks(mxfp4_dir, tmp_path, monkeypatch, strategy):
    """The official layout's blocks on the CPU kernels (biases and the clamp included): the
    logits within the int8 activations' rounding of resident's (about 1e-4 on this model)."""
    from freetoken.cpu import executor as cx

    if (why := cx.available()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    ref = our_logits(load_ours(mxfp4_dir), IDS, prefill=5)
    got = our_logits(load_ours(mxfp4_dir, strategy=strategy, cache=CacheSizing("size", 3),
                               max_fetch=1, online=False), IDS, prefill=5)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
