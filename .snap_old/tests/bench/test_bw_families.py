"""``ft bench bw`` benches each layer kind with its model's expert activation: Gemma-4's gelu
(tanh), Qwen3-MoE's silu, GPT-OSS's clamped SwiGLU with biases."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from freetoken.bench.bw import bench_kinds, collect_targets
from freetoken.checkpoint.synth import PRESETS, SynthSpec, parse_expert_formats, write_synth
from freetoken.cli import main
from freetoken.cpu import executor as cx

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

FAST = ["--device", "cpu", "--threads", "1", "--seconds", "0.02", "--experts", "8"]
GEMMA_TINY = dict(hidden=64, moe_intermediate=32, experts=8, layers=2, heads=4, kv_heads=2,
                  head_dim=16, full_head_dim=32, full_kv_heads=1, intermediate=96, vocab=512,
                  sliding_window=6)
OSS_TINY = dict(hidden=64, moe_intermediate=64, experts=8, layers=2, heads=4, kv_heads=2,
                head_dim=16, vocab=512, sliding_window=6)


def _tiny_gguf(preset: str, dims: dict[str, int], out: Path) -> Path:
    p = replace(PRESETS[preset], **dims)
    return write_synth(SynthSpec(p, parse_expert_formats(p.expert_format, p.layers)), out)


@pytest.fixture
def bw_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(path))
    return path


@pytest.fixture
def activations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The activation of every layer the bench registers with the CPU executor."""
    seen: list[str] = []
    add_layer = cx.CpuMoeExecutor.add_layer

    def spy(self: cx.CpuMoeExecutor, *args: Any, activation: str = "silu", **kw: Any) -> Any:
        seen.append(activation + (" biased" if kw.get("bias") is not None else ""))
        return add_layer(self, *args, activation=activation, **kw)

    monkeypatch.setattr(cx.CpuMoeExecutor, "add_layer", spy)
    return seen


def test_presets_carry_their_familys_activation() -> None:
    targets = collect_targets(presets=["qwen3-30b-a3b", "gemma4-26b-a4b",
                                       "gemma4-26b-a4b-mxfp4", "gpt-oss-20b"])
    got = {(t.sources[0], t.kind.fmt, t.activation, t.bias) for t in targets}
    assert got == {
        ("preset:qwen3-30b-a3b", "bf16", "silu", False),
        ("preset:gemma4-26b-a4b", "gguf", "gelu_pytorch_tanh", False),  # q8_0
        ("preset:gemma4-26b-a4b", "bf16", "gelu_pytorch_tanh", False),
        ("preset:gemma4-26b-a4b-mxfp4", "gguf", "gelu_pytorch_tanh", False),
        ("preset:gpt-oss-20b", "gguf", "swiglu_oai", True),
    }


def test_gemma4_checkpoint_is_benched_with_gelu(tmp_path: Path, bw_path: Path,
                                                activations: list[str]) -> None:
    gguf = _tiny_gguf("gemma4-26b-a4b-mxfp4", GEMMA_TINY, tmp_path / "gemma4.gguf")
    assert main(["bench", "bw", "--model", str(gguf), *FAST]) == 0
    rows = json.loads(bw_path.read_text())["layer_kinds"]
    assert list(rows) == ["gguf[down_type=39,gate_up_type=39]:64x32:top8:t1"]
    assert [r["meta"]["activation"] for r in rows.values()] == ["gelu_pytorch_tanh"]
    assert activations == ["gelu_pytorch_tanh"]


def test_gpt_oss_checkpoint_is_benched_with_its_clamped_biased_experts(
        tmp_path: Path, bw_path: Path, activations: list[str]) -> None:
    oss = _tiny_gguf("gpt-oss-20b", OSS_TINY, tmp_path / "oss.gguf")
    assert main(["bench", "bw", "--model", str(oss), *FAST]) == 0
    rows = json.loads(bw_path.read_text())["layer_kinds"]
    assert [r["meta"]["activation"] for r in rows.values()] == ["swiglu_oai"]
    assert activations == ["swiglu_oai biased"]
    assert all(r["cpu_gbps"] > 0 for r in rows.values())


def test_gpt_oss_preset_benched_beside_another(activations: list[str]) -> None:
    targets = collect_targets(presets=["gpt-oss-20b", "tiny"])
    rows = bench_kinds(targets, threads=1, device="cpu", seconds=0.02, experts=8)
    assert len(rows) == 2 and "bf16:64x32:top2:t1" in rows
    assert sorted(activations) == ["silu", "swiglu_oai biased"]
