"""nvfp4 against an e2m1 decode written from the format's definition, and by hand."""

from __future__ import annotations

import numpy as np
import torch

from freetoken.quant import QuantTensor, get_format


def e2m1_decode(code: np.ndarray) -> np.ndarray:
    """4-bit e2m1 codes -> float64: 1 sign, 2 exponent (bias 1), 1 mantissa bit."""
    sign = np.where(code >> 3, -1.0, 1.0)
    e = ((code >> 1) & 3).astype(np.float64)
    m = (code & 1).astype(np.float64)
    return sign * np.where(e == 0, 0.5 * m, 2.0 ** (e - 1) * (1 + m / 2))


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    e = ((b >> 3) & 0xF).astype(np.float64)
    m = (b & 0x7).astype(np.float64)
    magnitude = np.where(e == 0, 2.0**-6 * m / 8, 2.0 ** (e - 7) * (1 + m / 8))
    return np.where(b >> 7, -1.0, 1.0) * magnitude


def nvfp4(data: np.ndarray, scale_bytes: np.ndarray, global_scale: float) -> QuantTensor:
    shape = (*data.shape[:-1], data.shape[-1] * 2)
    scales = {
        "weight_scale": torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(global_scale, dtype=torch.float32),
    }
    return QuantTensor("nvfp4", shape, torch.from_numpy(data), scales)


def test_hand_computed_example() -> None:
    # weight_scale 1.5 (e4m3 0x3C), then 2.0 (0x40); global 0.25
    data = np.zeros((1, 16), dtype=np.uint8)
    data[0, :4] = [0x21, 0xF7, 0x9B, 0x08]  # (0.5, 1), (6, -6), (-1.5, -0.5), (-0, 0)
    data[0, 8] = 0x54  # (2, 3)
    out = get_format("nvfp4").dequantize(nvfp4(data, np.array([[0x3C, 0x40]], np.uint8), 0.25))
    want = torch.zeros(1, 32)
    want[0, :6] = torch.tensor([0.5, 1.0, 6.0, -6.0, -1.5, -0.5]) * 0.375
    want[0, 16:18] = torch.tensor([2.0, 3.0]) * 0.5
    assert torch.equal(out, want)


def test_dequantize_matches_formula() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(2, 5, 48), dtype=np.uint8)  # 3-D: 2 experts of 5 x 96
    scale_bytes = rng.integers(0, 0x7F, size=(2, 5, 6), dtype=np.uint8)  # finite, positive
    global_scale = float(np.float32(3.7e-4))
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(2, 5, 96)
    ref = e2m1_decode(codes) * e4m3_decode(scale_bytes).repeat(16, -1) * global_scale
    out = get_format("nvfp4").dequantize(nvfp4(data, scale_bytes, global_scale))
    assert torch.equal(out, torch.from_numpy(ref.astype(np.float32)))


def test_quantize_round_trip() -> None:
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    x[0, :16] = 0.0
    fmt = get_format("nvfp4")
    q = fmt.quantize(x)
    assert q.data.shape == (8, 128) and q.scales["weight_scale"].shape == (8, 16)
    assert q.scales["weight_scale_2"].shape == ()
    back = fmt.dequantize(q)
    assert torch.equal(back[0, :16], torch.zeros(16))
    # nearest e2m1: error at most half the widest gap (2 -> 1 of 6) of each group's scale
    step = q.scales["weight_scale"].float().repeat_interleave(16, -1) * q.scales["weight_scale_2"]
    assert torch.all((back - x).abs() <= step + 1e-12)
    assert (back - x).norm() / x.norm() < 0.12
