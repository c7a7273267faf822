"""The batched kernels of a prompt's dense matrices (weight panels; AMX, AVX512-VNNI and AVX2
tiers): each tier against the scalar twin bit for bit, the twin against the ``gguf``
package's dequantised weights in float64, every batch size giving a vector the same bits,
and the pool's linear jobs running them from ``batch_vectors()`` vectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.cpu import executor as cx
from freetoken.cpu import library as lib
from freetoken.quant import QuantTensor, get_format

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

# (rows, cols) per format: a partial last panel of rows, sub-block counts odd and even.
SHAPES = {"q8_0": (40, 96), "q4_0": (37, 160), "q5_0": (50, 640), "mxfp4": (17, 64),
          "q4_k": (33, 512), "q5_k": (29, 768), "q6_k": (21, 768)}
TIERS = ("avx2", "avx512_vnni", "avx512_bf16")  # the last is AMX's where the CPU has it
# Largest error against float64 on the dequantised weights, relative to the largest output:
# the int8 activations' rounding.
TOLERANCE = 2e-2


def quantised(fmt: str, seed: int = 0) -> QuantTensor:
    rows, cols = SHAPES[fmt]
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
    return get_format(fmt).quantize(w)


def weights(fmt: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's blocks (rows, row bytes) of a random matrix and the gguf package's float64
    dequantisation of them."""
    rows, cols = SHAPES[fmt]
    data = quantised(fmt, seed).data.reshape(rows, -1).contiguous()
    dense = dequantize(data.numpy(), GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    return data, torch.from_numpy(dense).reshape(rows, cols)


def vectors(fmt: str, M: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(M, SHAPES[fmt][1], generator=torch.Generator().manual_seed(seed))


def tier_or_skip(fmt: str, tier: str) -> None:
    got = lib.batch_isa(fmt, tier)
    if got != tier:
        pytest.skip(f"this CPU runs {fmt}'s batched kernel at {got}, not {tier}")


@pytest.mark.parametrize("fmt", list(SHAPES))
def test_scalar_twin_matches_gguf_dequantisation(fmt: str) -> None:
    data, dense = weights(fmt)
    x = vectors(fmt, 19)
    got, tier = lib.batch_linear(data, fmt, *SHAPES[fmt], x, "scalar")
    assert tier == "scalar"
    want = x.double() @ dense.T
    assert float((got.double() - want).abs().max() / want.abs().max()) < TOLERANCE


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_tier_gives_the_scalar_twins_bits(fmt: str, tier: str) -> None:
    tier_or_skip(fmt, tier)
    data, _ = weights(fmt)
    x = vectors(fmt, 37)  # two whole tiles of 16 vectors and a partial one
    want, _ = lib.batch_linear(data, fmt, *SHAPES[fmt], x, "scalar")
    got, ran = lib.batch_linear(data, fmt, *SHAPES[fmt], x, tier)
    assert ran == tier
    assert torch.equal(got, want)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k"])
def test_a_vector_gets_the_same_bits_in_any_batch(fmt: str, tier: str) -> None:
    tier_or_skip(fmt, tier)
    data, _ = weights(fmt)
    x = vectors(fmt, 40)
    whole, _ = lib.batch_linear(data, fmt, *SHAPES[fmt], x, tier)
    for lo, hi in ((0, 1), (3, 20), (17, 40)):
        part, _ = lib.batch_linear(data, fmt, *SHAPES[fmt], x[lo:hi], tier)
        assert torch.equal(part, whole[lo:hi])


@pytest.mark.parametrize("fmt", ["q5_0", "q5_k", "q6_k", "q8_0"])
def test_pool_linear_jobs_run_the_batched_kernel(fmt: str) -> None:
    """A job of batch_vectors() or more vectors gives the batched kernel's bits on the pool
    (every worker decoding its own panels); fewer run the row kernels."""
    data, dense = weights(fmt)
    rows, cols = SHAPES[fmt]
    ex = cx.CpuMoeExecutor(threads=1)
    lid = ex.add_linear(cx.ExpertStack.from_quant(quantised(fmt), copy=True))
    assert ex.linear_batch_isa(lid) is not None
    n = lib.batch_vectors()
    x = vectors(fmt, n + 21)
    ref, _ = lib.batch_linear(data, fmt, rows, cols, x, "scalar")
    assert torch.equal(ex.run_linear(x, lid), ref)
    assert torch.equal(ex.run_linear(x[:n], lid), ref[:n])
    small = ex.run_linear(x[: n - 1], lid)  # the row kernels: close, not the same bits
    want = x[: n - 1].double() @ dense.T
    assert float((small.double() - want).abs().max() / want.abs().max()) < TOLERANCE



# Where each format's block scale sits (byte offset in the block, bytes), to make random
# blocks finite: the quants of random bytes reach every value, the extremes included.
SCALE_BYTES = {"q8_0": (0, 2), "q4_0": (0, 2), "q5_0": (0, 2), "mxfp4": (0, 1), "q4_k": (0, 4),
               "q5_k": (0, 4), "q6_k": (208, 2)}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_extreme_quants_keep_exact_sums(fmt: str, tier: str) -> None:
    """Random bytes (every quant value, the largest magnitudes included) against activations
    that quantise to +-127 everywhere: the int16 partial sums of the AVX2 tier must not wrap."""
    tier_or_skip(fmt, tier)
    rows, cols = SHAPES[fmt]
    q = get_format(fmt)
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (rows, cols // q.block_size, q.block_bytes), generator=g,
                           dtype=torch.uint8)
    at, n = SCALE_BYTES[fmt]
    scale = {1: [127], 2: [0x00, 0x3C], 4: [0x00, 0x3C, 0x00, 0x38]}[n]  # 1.0 (dmin 0.5)
    blocks[:, :, at:at + n] = torch.tensor(scale, dtype=torch.uint8)
    data = blocks.reshape(rows, -1).contiguous()
    x = torch.where(torch.rand(9, cols, generator=g) < 0.5, -1.0, 1.0)
    x[1::2] = 1.0  # every value +127
    want, _ = lib.batch_linear(data, fmt, rows, cols, x, "scalar")
    got, _ = lib.batch_linear(data, fmt, rows, cols, x, tier)
    assert torch.equal(got, want)
    dense = dequantize(data.numpy(), GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    ref = x.double() @ torch.from_numpy(dense).reshape(rows, cols).T
    assert float((want.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_pool_items_of_several_panels_and_slices() -> None:
    """A matrix tall enough for items of several panels (the last one partial) and a prompt
    longer than one slice of vectors: the same bits as the one-panel-at-a-time reference."""
    fmt, rows, cols = "q5_0", 300, 640
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)) / cols**0.5
    qt = get_format(fmt).quantize(w)
    ex = cx.CpuMoeExecutor(threads=1)
    lid = ex.add_linear(cx.ExpertStack.from_quant(qt, copy=True))
    x = torch.randn(150, cols, generator=torch.Generator().manual_seed(5))
    want, _ = lib.batch_linear(qt.data.reshape(rows, -1), fmt, rows, cols, x, "scalar")
    assert torch.equal(ex.run_linear(x, lid), want)
