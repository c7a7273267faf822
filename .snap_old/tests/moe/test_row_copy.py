"""The library's row copies (cpu/row_copy.py) against torch's indexing, on the CPU and on CUDA
streams; offload through them gives the same logits and cache slots as through torch's."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.config import CacheSizing
from freetoken.cpu.row_copy import RowCopier
from freetoken.moe.offload import OffloadExperts
from tests.models.helpers import load_ours, our_logits
from tests.moe.test_offload import IDS


def _rows(rng: random.Random, n: int, of: int, runs: bool) -> list[int]:
    if runs:  # consecutive runs, which the library merges into one copy each
        start = rng.randrange(of - n)
        return list(range(start, start + n))
    return rng.sample(range(of), n)


@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_cpu_rows_equal_torch_indexing(seed, runs):
    rng = random.Random(seed)
    src = torch.randint(0, 256, (40, 1000), dtype=torch.uint8)
    dst = torch.randint(0, 256, (24, 1000), dtype=torch.uint8)
    want = dst.clone()
    n = rng.randrange(1, 12)
    d, s = _rows(rng, n, 24, runs), _rows(rng, n, 40, runs)
    want[d] = src[s]
    RowCopier(cuda=False).copy(dst, d, src, s)
    assert torch.equal(dst, want)


def test_strided_rows_and_bad_shapes():
    src = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    big = torch.zeros(8, 128, dtype=torch.uint8)
    dst = big[:, :64]  # rows 128 bytes apart
    RowCopier(cuda=False).copy(dst, [0, 1, 2], src, [5, 6, 7])
    assert torch.equal(big[:3, :64], src[5:8]) and not big[:, 64:].any()
    with pytest.raises(ValueError, match="3 destination rows for 2"):
        RowCopier(cuda=False).copy(dst, [0, 1, 2], src, [5, 6])
    with pytest.raises(ValueError, match="contiguous uint8 rows of one size"):
        RowCopier(cuda=False).copy(torch.zeros(8, 32, dtype=torch.uint8), [0], src, [0])


def test_tensor_copies_equal_torch_copies():
    """Several buffers in one call (a host step's inputs), bytes for bytes; unequal sizes are
    refused before anything is copied."""
    srcs = [torch.randn(3, 5), torch.randint(-9, 9, (3, 2)), torch.randn(3, 2)]
    dsts = [torch.zeros_like(t) for t in srcs]
    RowCopier(cuda=False).copy_tensors(list(zip(dsts, srcs, strict=True)))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    with pytest.raises(ValueError, match="copy 1: .* not a contiguous copy of equal bytes"):
        RowCopier(cuda=False).copy_tensors([(dsts[0], srcs[0]), (torch.zeros(4), srcs[1])])


def _offload(checkpoint, monkeypatch, how: str, device: str = "cpu",
             dtype: torch.dtype = torch.float32):
    monkeypatch.setenv("FREETOKEN_ROW_COPY", how)
    model = load_ours(checkpoint, dtype, device, "offload", CacheSizing("size", 3))
    logits = our_logits(model, IDS, 1, device)
    experts = [m for m in model.modules() if isinstance(m, OffloadExperts)]
    assert (experts[0].runtime.rows is None) == (how == "torch")
    pools = [p.data.cpu() for p in experts[0].runtime.cache.pools]
    return logits, pools


def test_offload_through_library_copies_equals_torch_copies(tiny_qwen3_moe, monkeypatch,
                                                            gather_on_cpu):
    """The slow twin: same logits, and the cache holds the same bytes in the same slots."""
    native, native_pools = _offload(tiny_qwen3_moe, monkeypatch, "native")
    twin, twin_pools = _offload(tiny_qwen3_moe, monkeypatch, "torch")
    assert torch.equal(native, twin)
    assert all(torch.equal(a, b) for a, b in zip(native_pools, twin_pools, strict=True))


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(3))
def test_cuda_rows_on_the_copy_stream(seed):
    """Pinned host rows into device rows on a side stream, ordered after the compute stream's
    work and waited for by it; the events time the copies."""
    rng = random.Random(seed)
    src = torch.randint(0, 256, (40, 1 << 16), dtype=torch.uint8).pin_memory()
    dst = torch.zeros(24, 1 << 16, dtype=torch.uint8, device="cuda")
    dst.fill_(7)  # queued on the compute stream: the copies must land after it
    copy_stream = torch.cuda.Stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    for e in events:
        e.record()
    d, s = _rows(rng, 10, 24, seed == 1), _rows(rng, 10, 40, seed == 1)
    RowCopier(cuda=True).copy(dst, d, src, s, torch.cuda.current_stream().cuda_stream,
                              copy_stream.cuda_stream, *(e.cuda_event for e in events),
                              compute_waits=True)
    out = dst.cpu()  # on the compute stream, which waits for the copies
    want = torch.full((24, 1 << 16), 7, dtype=torch.uint8)
    want[d] = src[s]
    assert torch.equal(out, want)
    assert events[1].elapsed_time(events[2]) > 0


@pytest.mark.cuda
def test_cuda_tensor_copies_both_ways_then_sync():
    from freetoken.cpu.row_copy import current_stream

    host = torch.randn(4, 1000).pin_memory()
    dev = torch.zeros(4, 1000, device="cuda")
    back = torch.zeros(4, 1000).pin_memory()
    stream = current_stream(0)
    RowCopier(cuda=True).copy_tensors([(dev, host), (back, dev)], stream, sync=True)
    assert torch.equal(back, host)  # in order on the stream, and the host waited


@pytest.mark.cuda
def test_cuda_offload_through_library_copies_equals_torch_copies(tiny_qwen3_moe, monkeypatch):
    native, native_pools = _offload(tiny_qwen3_moe, monkeypatch, "native", "cuda",
                                    torch.bfloat16)
    twin, twin_pools = _offload(tiny_qwen3_moe, monkeypatch, "torch", "cuda", torch.bfloat16)
    assert torch.equal(native, twin)
    assert all(torch.equal(a, b) for a, b in zip(native_pools, twin_pools, strict=True))
