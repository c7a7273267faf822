"""Bad checkpoints give one clear error naming the problem and the fix, never a crash or hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.errors import CheckpointError


@pytest.fixture(scope="module")
def tiny_gguf(tiny_qwen3_moe, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), out, lambda n, s: "f32")


def test_missing_path():
    with pytest.raises(CheckpointError, match="not found: pass a Hugging Face model directory"):
        open_checkpoint("/nonexistent/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        open_checkpoint(tmp_path)


def test_unknown_architecture(tiny_qwen3_moe, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_qwen3_moe, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'MambaForCausalLM'.*supported: Qwen3Moe"):
        open_checkpoint(d)


def test_missing_shard(tiny_qwen3_moe, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_qwen3_moe, d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002.safetensors"):
        open_checkpoint(d)


def test_truncated_safetensors(tiny_qwen3_moe, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_qwen3_moe, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        open_checkpoint(d)


@pytest.mark.parametrize("keep", [3, 100, 5000, -100])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(CheckpointError, match="truncated|not a GGUF"):
        open_checkpoint(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip file")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        open_checkpoint(bad)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    w = GGUFWriter(path, "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'mamba'"):
        open_checkpoint(path)


def test_unsupported_tensor_type(tiny_gguf, tmp_path):
    from freetoken.checkpoint.gguf import GGUFCheckpoint

    src = GGUFCheckpoint(tiny_gguf)
    path = tmp_path / "iq.gguf"
    w = GGUFWriter(path, "qwen3moe")
    for k, v in src.metadata.items():
        if k.startswith("qwen3moe.") and isinstance(v, int):
            w.add_uint32(k, v)
        elif k.startswith("qwen3moe."):
            w.add_float32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    # IQ2_XXS: 66 bytes per 256 elements
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((8, 64, 66 // 1), dtype=np.uint8),
                 raw_dtype=GGMLQuantizationType.IQ2_XXS)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match="unsupported GGUF tensor type IQ2_XXS"):
        open_checkpoint(path)


def test_cli_reports_one_line_and_exits_nonzero(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--device", "cpu",
                        "--model", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("ft generate: error: ")
    assert "truncated" in r.stderr and "Traceback" not in r.stderr


def test_hub_id_not_in_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="neither a local path nor in the Hugging Face cache"):
        open_checkpoint("Qwen/Qwen3-30B-A3B")
