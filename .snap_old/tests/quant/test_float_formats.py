"""f32 / f16 / bf16: bytes like gguf writes them, dequantised from native dtype or raw bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from freetoken.quant import QuantTensor, get_format
from freetoken.quant.floats import FloatFormat

GGML_TYPE = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
}


def tricky_floats(shape: tuple[int, ...]) -> np.ndarray:
    """Random values plus specials: signed zeros, infinities, NaNs, subnormals, rounding ties."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 6, shape)).astype(np.float32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-42, 65520.0, 1e38, 6e-8],
        dtype=np.float32,
    )
    ties = (np.array([0x3F808000, 0x3F818000, 0xBF808001], dtype=np.uint32)).view(np.float32)
    flat = x.reshape(-1)
    flat[: len(specials)] = specials
    flat[len(specials) : len(specials) + len(ties)] = ties
    return x


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # numpy's f16 cast of 1e38
@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 32)])
@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_quantize_matches_gguf(name: str, shape: tuple[int, ...]) -> None:
    x = tricky_floats(shape)
    fmt = get_format(name)
    q = fmt.quantize(torch.from_numpy(x))
    assert isinstance(fmt, FloatFormat) and q.data.dtype == fmt.dtype
    ours = q.data.contiguous().view(torch.uint8).numpy()
    ref = gguf_quantize(x, GGML_TYPE[name]).view(np.uint8).reshape(ours.shape)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("shape", [(4, 64), (2, 3, 32)])
@pytest.mark.parametrize("name", ["f32", "f16", "bf16"])
def test_dequantize_native_and_bytes(name: str, shape: tuple[int, ...]) -> None:
    fmt = get_format(name)
    q = fmt.quantize(torch.from_numpy(tricky_floats(shape)))
    raw = q.data.contiguous().view(torch.uint8)
    assert tuple(raw.shape) == (*shape[:-1], fmt.row_bytes(shape[-1]))
    native = fmt.dequantize(q)
    from_bytes = fmt.dequantize(QuantTensor(name, shape, raw))
    ref = torch.from_numpy(gguf_dequantize(raw.numpy(), GGML_TYPE[name]))
    for out in (native, from_bytes):
        assert out.dtype == torch.float32 and tuple(out.shape) == shape
        assert torch.equal(out.nan_to_num(), ref.reshape(shape).nan_to_num())
        assert torch.equal(out.isnan(), ref.reshape(shape).isnan())


def test_dequantize_never_aliases() -> None:
    fmt = get_format("f32")
    x = torch.ones(2, 8)
    out = fmt.dequantize(QuantTensor("f32", (2, 8), x))
    out.zero_()
    assert torch.equal(x, torch.ones(2, 8))


def test_wrong_dtype_is_rejected() -> None:
    t = QuantTensor("bf16", (2, 8), torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="bf16: expected torch.bfloat16"):
        get_format("bf16").dequantize(t)
