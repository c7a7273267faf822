"""GGUF NVFP4 against the gguf package: its blocks read into our nvfp4 layout dequantise to
the package's values bit for bit (every scale byte and code), our quantiser picks the bytes a
reference built from the package's own scale codec picks, and the package reads them back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import NVFP4 as GGUF_NVFP4
from gguf.quants import dequantize

from freetoken.quant import (
    format_for_gguf_type,
    get_format,
    gguf_quantize,
    gguf_read,
    gguf_row_bytes,
    gguf_type_of,
    nvfp4_gguf,
)

NVFP4 = GGMLQuantizationType.NVFP4


def _bits(x: np.ndarray | torch.Tensor) -> np.ndarray:
    """float32 values as their bit patterns (so -0 != +0)."""
    a = x.numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _ours(raw: np.ndarray) -> torch.Tensor:
    *lead, row = raw.shape
    qt = gguf_read("nvfp4", torch.from_numpy(raw), (*lead, row // 36 * 64))
    assert qt.fmt == "nvfp4" and qt.data.shape == (*lead, row // 36 * 32)
    return get_format("nvfp4").dequantize(qt)


def test_the_layout_is_the_packages() -> None:
    assert GGML_QUANT_SIZES[NVFP4] == (nvfp4_gguf.BLOCK, nvfp4_gguf.BLOCK_BYTES) == (64, 36)
    assert nvfp4_gguf.GGUF_TYPE == NVFP4 == gguf_type_of("nvfp4")
    assert format_for_gguf_type(NVFP4).name == "nvfp4"
    assert gguf_row_bytes("nvfp4", 128) == 72
    assert get_format("nvfp4").gguf_type is None  # the CPU kernels read it as nvfp4, not gguf


def test_every_scale_byte_and_code_dequantises_to_the_packages() -> None:
    # 255 scale bytes (0xFF excepted, below) x every code byte in every position
    blocks = np.zeros((255, 8, 36), dtype=np.uint8)
    blocks[..., :4] = np.arange(255, dtype=np.uint8)[:, None, None]
    codes = (np.arange(256, dtype=np.uint32) * 37 % 256).astype(np.uint8).reshape(8, 32)
    blocks[..., 4:] = codes
    raw = blocks.reshape(255, 8 * 36)
    ref = dequantize(raw, NVFP4).reshape(255, 8 * 64)
    assert np.array_equal(_bits(_ours(raw)), _bits(ref))


def test_random_blocks_dequantise_to_the_packages() -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(3, 7, 5, 36), dtype=np.uint8)  # 3 experts of 7 x 320
    scales = raw[..., :4]
    scales[scales == 0xFF] = 0x7F
    raw = raw.reshape(3, 7, 5 * 36)
    ref = dequantize(raw, NVFP4).reshape(3, 7, 320)
    got = _ours(raw)
    assert np.array_equal(_bits(got), _bits(ref))
    assert torch.count_nonzero(got) > 0.8 * got.numel()


def test_a_scale_byte_of_480_is_refused() -> None:
    raw = np.zeros((1, 36), dtype=np.uint8)
    raw[0, 2] = 0xFF
    assert dequantize(raw, NVFP4)[0, 32:48].max() == 0  # all codes 0: the package gives 0 too
    with pytest.raises(ValueError, match="scale byte 0xFF"):
        _ours(raw)


def test_scale_rounding_is_the_packages() -> None:
    rng = np.random.default_rng(1)
    exact = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    mids = (exact[1:] + exact[:-1]) / 2  # the ties
    x = np.concatenate([
        exact, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
        rng.random(4000) * 600, rng.random(4000) * 0.03, 10.0 ** rng.uniform(-5, 3, 4000),
        [0.0, -1.0, 2.0**-10, 15 / 1024, 0.0155, 239.9, 240.0, 255.9, 256.0, 448.0, 1e9],
    ]).astype(np.float32)
    got = nvfp4_gguf.ue4m3(torch.from_numpy(x)).numpy()
    assert np.array_equal(got, GGUF_NVFP4.fp32_to_ue4m3(x))


def _reference_blocks(x: np.ndarray) -> np.ndarray:
    """ggml's reference quantiser from its definition, on the package's scale codec: per 16,
    the scale ``ue4m3(amax / 6)``, each code the first nearest of the doubled e2m1 table times
    the package's (halved) decoded scale; 8 bytes per 16, low nibbles the first 8 weights."""
    xs = x.reshape(-1, 16)
    d = GGUF_NVFP4.fp32_to_ue4m3(np.abs(xs).max(-1) / np.float32(6))
    half = GGUF_NVFP4.ue4m3_to_fp32(d).astype(np.float32)
    table = np.array(GGUF_NVFP4.kvalues, dtype=np.float32)
    codes = np.abs(half[:, None, None] * table - xs[..., None]).argmin(-1).astype(np.uint8)
    qs = codes[:, :8] | (codes[:, 8:] << 4)
    subs = d.reshape(-1, 4)
    return np.concatenate([subs, qs.reshape(-1, 32)], axis=-1).reshape(*x.shape[:-1], -1)


def test_quantize_picks_the_reference_bytes_and_reads_back() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-4, 2, 6).unsqueeze(-1)
    x[0, :16] = 0.0
    x[1, 16:32] = 1e-7  # a sub-block whose scale rounds to 0
    blocks = gguf_quantize("nvfp4", x)
    assert blocks.shape == (6, 4 * 36)
    assert np.array_equal(blocks.numpy(), _reference_blocks(x.numpy()))
    back = dequantize(blocks.numpy(), NVFP4).reshape(6, 256)
    qt = nvfp4_gguf.quantize(x)
    assert np.array_equal(_bits(get_format("nvfp4").dequantize(qt)), _bits(back))
    assert np.array_equal(_bits(_ours(blocks.numpy())), _bits(back))
    # 4-bit accuracy where the scales are normal; far smaller weights underflow: with no
    # global scale the smallest scale is 2**-9
    rel = (torch.from_numpy(back) - x).norm(dim=-1) / x.norm(dim=-1)
    assert (rel[2:] < 0.12).all() and (rel[2:] > 0.02).all()
    assert not back[1].any()


def test_write_inverts_read() -> None:
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(4, 2, 36), dtype=np.uint8)
    scales, qs = raw[..., :4], raw[..., 4:]
    scales[...] = scales % 0x7F
    lo, hi = qs & 0x0F, qs >> 4
    qs[...] = np.where(lo == 8, 0, lo) | (np.where(hi == 8, 0, hi) << 4)  # no -0 codes
    raw = raw.reshape(4, 72)
    t = gguf_read("nvfp4", torch.from_numpy(raw), (4, 128))
    assert np.array_equal(nvfp4_gguf.write(t).numpy(), raw)
    with pytest.raises(ValueError, match="no global scale"):
        nvfp4_gguf.write(get_format("nvfp4").quantize(torch.randn(4, 128)))
