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
          "q4_k": (33, 512), "q6_k": (21, 768)}
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
def test_a_vector_gets_the_same_bits_in_any_batch(tier: str) -> None:
    fmt = "q4_k"
    tier_or_skip(fmt, tier)
    data, _ = weights(fmt)
    x = vectors(fmt, 40)
    whole, _ = lib.batch_linear(data, fmt, *SHAPES[fmt], x, tier)
    for lo, hi in ((0, 1), (3, 20), (17, 40)):
        part, _ = lib.batch_linear(data, fmt, *SHAPES[fmt], x[lo:hi], tier)
        assert torch.equal(part, whole[lo:hi])


@pytest.mark.parametrize("fmt", ["q5_0", "q6_k", "q8_0"])
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

