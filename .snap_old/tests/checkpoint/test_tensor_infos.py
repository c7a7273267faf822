"""``tensor_infos()``: every reader's formats, shapes and sizes without reading data, equal to
what ``tensors()`` yields and to the ``gguf`` package's and ``safetensors``' own headers; and a
plan over an all-NVFP4 GGUF that repacks nothing."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open

from freetoken.checkpoint import Checkpoint, open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.checkpoint.names import gguf_to_ours
from freetoken.checkpoint.synth import PRESETS, SynthSpec, parse_expert_formats, write_synth
from freetoken.config import CacheSizing, EngineConfig
from freetoken.moe import plan
from freetoken.moe.host_banks import expert_bytes
from freetoken.moe.layer_kind import layer_kinds
from freetoken.quant import gguf_type_of, nvfp4_gguf

# the tiny Gemma-4 of tests/checkpoint/test_synth_archs.py, its expert rows a multiple of 64
NVFP4_TINY = dict(hidden=64, moe_intermediate=64, experts=8, layers=6, heads=4, kv_heads=2,
                  head_dim=16, full_head_dim=32, full_kv_heads=1, intermediate=96, vocab=512,
                  sliding_window=6)


def _read(ckpt: Checkpoint) -> list[tuple[str, str, tuple[int, ...], int]]:
    return [(n, qt.fmt, tuple(qt.shape), qt.nbytes) for n, qt in ckpt.tensors()]


def _infos(ckpt: Checkpoint) -> list[tuple[str, str, tuple[int, ...], int]]:
    return [(t.name, t.fmt, t.shape, t.nbytes) for t in ckpt.tensor_infos()]


def _nvfp4_gguf(path: Path) -> Path:
    p = replace(PRESETS["gemma4-26b-a4b-nvfp4"], **NVFP4_TINY)
    torch.manual_seed(0)
    return write_synth(SynthSpec(p, parse_expert_formats(p.expert_format, p.layers), 0.5, 0.5, 1),
                       path)


def _against_gguf_package(path: Path, ckpt: Checkpoint) -> None:
    """Each info's shape and GGML type are the gguf package's; its bytes the file's, except
    where the blocks are repacked on reading (NVFP4)."""
    infos = {t.name: t for t in ckpt.tensor_infos()}
    seen = 0
    for t in GGUFReader(path).tensors:
        ours = gguf_to_ours(t.name, ckpt.config.family)
        if ours is None:
            continue
        info, seen = infos[ours], seen + 1
        assert info.shape == tuple(int(n) for n in reversed(t.shape.tolist())), ours
        if not (ckpt.config.family == "gemma3" and ours.endswith("norm.weight")):
            assert gguf_type_of(info.fmt) == int(t.tensor_type), ours
            if info.fmt != "nvfp4":
                assert info.nbytes == int(t.n_bytes), ours
    assert seen == len(infos)


@pytest.mark.parametrize("experts", ["f32", "bf16", "q8_0", "mxfp4"])
def test_gguf_infos_are_what_tensors_yield(tiny_gemma4, tmp_path, experts):
    gguf = convert_to_gguf(open_checkpoint(tiny_gemma4), tmp_path / "m.gguf",
                           lambda n, s: experts if ".experts." in n else "f32")
    ckpt = open_checkpoint(gguf)
    assert _infos(ckpt) == _read(ckpt)
    _against_gguf_package(gguf, ckpt)


def test_gguf_infos_of_shifted_gemma3_norms(tiny_gemma3, tmp_path):
    """Gemma-3's norms are read as float32 ``w`` from the stored ``1 + w``: so are their infos."""
    gguf = convert_to_gguf(open_checkpoint(tiny_gemma3), tmp_path / "g3.gguf",
                           lambda n, s: "bf16" if len(s) > 1 else "f32")
    ckpt = open_checkpoint(gguf)
    assert _infos(ckpt) == _read(ckpt)
    assert {t.fmt for t in ckpt.tensor_infos() if t.name.endswith("norm.weight")} == {"f32"}
    _against_gguf_package(gguf, ckpt)


def test_nvfp4_gguf_infos_are_the_repacked_tensors_without_repacking(tmp_path, monkeypatch):
    gguf = _nvfp4_gguf(tmp_path / "nv.gguf")
    ckpt = open_checkpoint(gguf)
    calls = _count_repacks(monkeypatch)
    infos = _infos(ckpt)
    assert calls == []
    assert infos == _read(ckpt)
    nv = [i for i in infos if i[1] == "nvfp4"]
    assert len(calls) == len(nv) == 2 * NVFP4_TINY["layers"]
    for _, _, shape, nbytes in nv:  # codes, a scale byte per 16, the global scale
        assert nbytes == math.prod(shape) // 2 + math.prod(shape) // 16 + 4
    _against_gguf_package(gguf, ckpt)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_gemma4", "tiny_gpt_oss"])
def test_hf_infos_are_what_tensors_yield(fixture, request):
    """Per-expert (Qwen3-MoE), stacked (Gemma-4) and transposed, interleaved (GPT-OSS) experts:
    the infos follow the same layouts with no data read."""
    path = request.getfixturevalue(fixture)
    ckpt = open_checkpoint(path)
    infos = _infos(ckpt)
    assert infos == _read(ckpt)
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = {n: f.get_slice(n) for n in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        total = sum(math.prod(s.get_shape()) * _itemsize(s.get_dtype()) for s in stored.values())
    assert sum(i[3] for i in infos) == total
    if fixture != "tiny_gpt_oss":  # GPT-OSS's experts come out under other names
        for name, _, shape, _ in infos:
            hf = name if name in stored else name.replace("model.", "model.language_model.", 1)
            assert shape == tuple(stored[hf].get_shape()), name


def _itemsize(dtype: str) -> int:
    return {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I64": 8}[dtype]


def _count_repacks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call of the NVFP4 repack from now on, recorded (it still runs)."""
    calls: list[int] = []
    real = nvfp4_gguf._repack

    def counted(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(blocks.shape[0])
        return real(blocks)

    monkeypatch.setattr(nvfp4_gguf, "_repack", counted)
    return calls


@pytest.mark.parametrize("strategy", ["auto", "offload", "hybrid"])
def test_planning_an_nvfp4_gguf_repacks_nothing(tmp_path, monkeypatch, strategy):
    """The plan reads formats and sizes from the header: layer kinds, the expert bytes of the
    host banks, the device bytes of resident layers; loading is what repacks."""
    gguf = _nvfp4_gguf(tmp_path / "nv.gguf")
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    ckpt = open_checkpoint(gguf)
    calls = _count_repacks(monkeypatch)
    cfg = EngineConfig(model=str(gguf), device="cpu", dtype="float32", moe_strategy=strategy,
                       max_seq_len=64, moe_cpu_threads=1, moe_cache=CacheSizing("auto", 0.0))
    moe = plan.plan_moe(cfg, ckpt, torch.device("cpu"))
    layers = NVFP4_TINY["layers"]
    assert len(moe.strategies) == layers
    assert [len(ids) for ids in layer_kinds(ckpt).values()] == [layers]
    assert expert_bytes(ckpt) > 0 and plan._device_bytes(cfg, ckpt)[1] > 0
    assert calls == []
    sum(qt.nbytes for _, qt in ckpt.tensors())
    assert len(calls) == 2 * layers  # the spy sees what reading does
