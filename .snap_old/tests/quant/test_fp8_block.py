"""fp8_block against an e4m3 decode written from the format's definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.quant import QuantTensor, get_format


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bytes -> float64: 1 sign, 4 exponent (bias 7), 3 mantissa bits."""
    sign = np.where(b >> 7, -1.0, 1.0)
    e = ((b >> 3) & 0xF).astype(np.float64)
    m = (b & 0x7).astype(np.float64)
    magnitude = np.where(e == 0, 2.0**-6 * m / 8, 2.0 ** (e - 7) * (1 + m / 8))
    return sign * magnitude


@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (2, 130, 129)])
def test_dequantize_matches_formula(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # e4m3fn has no inf; 0x7F / 0xFF are its NaNs
    *lead, rows, cols = shape
    tiles = (*lead, -(-rows // 128), -(-cols // 128))
    scale = (2.0 ** rng.uniform(-12, 4, tiles)).astype(np.float32)
    t = QuantTensor(
        "fp8_block",
        shape,
        torch.from_numpy(raw).view(torch.float8_e4m3fn),
        {"weight_scale_inv": torch.from_numpy(scale)},
    )
    per_element = scale.repeat(128, -2)[..., :rows, :].repeat(128, -1)[..., :cols]
    ref = (e4m3_decode(raw) * per_element).astype(np.float32)
    out = get_format("fp8_block").dequantize(t)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.from_numpy(ref))


def test_quantize_round_trip() -> None:
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    x[:128, :128] *= 1e-3  # tiles get their own scale
    x[150:, 280:] = 0.0  # an all-zero partial edge tile
    fmt = get_format("fp8_block")
    q = fmt.quantize(x)
    assert q.data.dtype == torch.float8_e4m3fn
    assert tuple(q.scales["weight_scale_inv"].shape) == (2, 3)
    back = fmt.dequantize(q)
    assert torch.equal(back[150:, 280:], torch.zeros(50, 20))
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 per element (normal range)
    big = x.abs() > x.abs().amax() * 2**-6
    assert torch.all((back - x).abs()[big] <= x.abs()[big] * 2**-4)


def test_wrong_scale_shape_is_rejected() -> None:
    t = QuantTensor(
        "fp8_block",
        (200, 300),
        torch.zeros(200, 300, dtype=torch.float8_e4m3fn),
        {"weight_scale_inv": torch.ones(1, 3)},
    )
    with pytest.raises(ValueError, match=r"weight_scale_inv \(2, 3\)"):
        get_format("fp8_block").dequantize(t)
