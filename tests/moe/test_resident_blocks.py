"""Resident experts kept as their checkpoint's blocks (what a GPU gets): read in place by the
fused kernels at decode (Triton's interpreter on the CPU here), dequantised one expert at a
time at prefill. Checked against the parameters path, which dequantised the same blocks at
load, and against offload, whose slots hold the same bytes and run the same kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.moe import resident
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.resident import ResidentExperts, reference_experts
from tests.models.helpers import load_ours, our_logits

pytest.importorskip("triton")
IDS = [3, 17, 99, 5, 42, 42, 7, 128, 64, 1, 200, 31]


@pytest.fixture
def blocks_on_cpu(monkeypatch):
    """Resident layers keep blocks on the CPU as they would on a GPU."""
    monkeypatch.setattr(resident, "keeps_blocks", lambda device: True)


@pytest.fixture
def as_blocks(blocks_on_cpu, gather_on_cpu):
    """... and decode calls take the GPU's path (the fused kernels)."""


def _gguf(src, out, fmt):
    return convert_to_gguf(open_checkpoint(src), out,
                           lambda n, s: fmt(n) if ".experts." in n else "f32")


def _experts(model) -> list[ResidentExperts]:
    return [m for m in model.modules() if isinstance(m, ResidentExperts)]


@pytest.mark.parametrize("gate_up", ["q8_0", "q5_0"])
def test_blocks_follow_the_dequantised_parameters(tiny_qwen3_moe, tmp_path, blocks_on_cpu,
                                                  monkeypatch, gate_up):
    path = _gguf(tiny_qwen3_moe, tmp_path / "m.gguf",
                 lambda n: "q8_0" if "down" in n else gate_up)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(resident, "keeps_blocks", lambda device: False)
        params = load_ours(path)
    blocks = load_ours(path)
    kept = _experts(blocks)
    assert kept and all(e.in_blocks is not None and e.blocks is not None for e in kept)
    assert all(not list(e.parameters()) for e in kept)  # no dequantised copy beside the blocks
    assert all(e.in_blocks is None for e in _experts(params))
    # expert by expert (prefill's path): the same dequantised weights, the same matmuls
    want = our_logits(params, IDS, prefill=5)
    assert torch.equal(our_logits(blocks, IDS, prefill=5), want)
    # pairs at once (decode's on a GPU): the fused kernels, float32 sums in their own order
    from freetoken.kernels.expert_matmul import GATHER_MAX_PAIRS
    monkeypatch.setattr(resident, "use_gather", lambda x, ids: ids.numel() <= GATHER_MAX_PAIRS)
    got = our_logits(blocks, IDS, prefill=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, want)


def test_blocks_equal_offload_bitwise(tiny_qwen3_moe, tmp_path, as_blocks, monkeypatch):
    """Offload's fused slots and resident's blocks as the file has them: the same bytes
    through the same kernel."""
    monkeypatch.setenv("FREETOKEN_RESIDENT_BLOCKS", "file")
    path = _gguf(tiny_qwen3_moe, tmp_path / "m.gguf", lambda n: "q8_0")
    want = our_logits(load_ours(path), IDS, prefill=1)
    model = load_ours(path, strategy="offload", cache=CacheSizing("size", 4))
    for m in model.modules():
        if isinstance(m, OffloadExperts):
            m.gpu_kernel = "fused"
    assert torch.equal(our_logits(model, IDS, prefill=1), want)


def test_blocks_match_the_slow_twin(tiny_qwen3_moe, tmp_path, as_blocks):
    path = _gguf(tiny_qwen3_moe, tmp_path / "m.gguf", lambda n: "q8_0")
    e = _experts(load_ours(path))[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, e.shape.hidden, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2, generator=g)
    torch.testing.assert_close(e.from_blocks(x, ids, w), reference_experts(e, x, ids, w),
                               rtol=1e-5, atol=1e-5)


def test_formats_without_a_kernel_become_parameters(tiny_qwen3_moe, tmp_path, as_blocks):
    """bf16 experts have no fused kernel: they are dequantised into parameters at load, and
    compute as the parameters path does."""
    path = _gguf(tiny_qwen3_moe, tmp_path / "m.gguf", lambda n: "bf16")
    model = load_ours(path)
    assert all(e.in_blocks is None and e.gate_proj.shape[0] == e.shape.num_experts
               for e in _experts(model))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(resident, "keeps_blocks", lambda device: False)
        want = our_logits(load_ours(path), IDS, prefill=5)
    assert torch.equal(our_logits(model, IDS, prefill=5), want)


@pytest.mark.cuda
def test_blocks_on_the_gpu(tiny_qwen3_moe, tmp_path, monkeypatch):
    """On a GPU resident keeps the blocks by itself; graph-free decode through the fused
    kernels follows the CPU's dequantised parameters and, as the file's blocks, equals
    offload's fused slots."""
    monkeypatch.setenv("FREETOKEN_RESIDENT_BLOCKS", "file")
    path = _gguf(tiny_qwen3_moe, tmp_path / "m.gguf", lambda n: "q8_0")
    model = load_ours(path, device="cuda")
    assert all(e.in_blocks == "q8_0" for e in _experts(model))
    got = our_logits(model, IDS, prefill=1, device="cuda")
    torch.testing.assert_close(got, our_logits(load_ours(path), IDS, prefill=1),
                               rtol=1e-4, atol=1e-4)
    off = load_ours(path, device="cuda", strategy="offload", cache=CacheSizing("size", 4))
    assert all(m.gpu_kernel == "fused" for m in off.modules() if isinstance(m, OffloadExperts))
    assert torch.equal(our_logits(off, IDS, prefill=1, device="cuda"), got)


def test_regrouped_blocks_follow_the_files_blocks(wide_qwen3_moe_q8, as_blocks, monkeypatch):
    """Resident's Q8_0 blocks regrouped as Q8_0x8 (the default) hold the same weights:
    prefill (dequantised) gives the file layout's logits bit for bit; decode through the
    float reader within float32 rounding, through the default reader (x as int8 blocks)
    within x's rounding."""
    from freetoken.kernels import gemv_launch

    monkeypatch.setenv("FREETOKEN_RESIDENT_BLOCKS", "file")
    as_file = load_ours(wide_qwen3_moe_q8)
    monkeypatch.delenv("FREETOKEN_RESIDENT_BLOCKS")
    regrouped = load_ours(wide_qwen3_moe_q8)
    assert {e.in_blocks for e in _experts(as_file)} == {"q8_0"}
    assert {e.in_blocks for e in _experts(regrouped)} == {"q8_0x8"}
    ids = IDS[:6]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(resident, "use_gather", lambda x, ids: False)
        assert torch.equal(our_logits(regrouped, ids, prefill=3),
                           our_logits(as_file, ids, prefill=3))
    want = our_logits(as_file, ids, prefill=1)
    assert gemv_launch.launch("q8_0x8").int8_x
    int8_x = our_logits(regrouped, ids, prefill=1)
    assert (int8_x - want).norm() < 0.02 * want.norm()
    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8", dataclasses.replace(
        gemv_launch.KERNELS["q8_0x8"], int8_x=False))
    torch.testing.assert_close(our_logits(regrouped, ids, prefill=1), want, rtol=1e-4,
                               atol=1e-4)
