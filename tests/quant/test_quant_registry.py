"""The format table: names, GGUF type lookup, error messages, and every row's basic contract."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from freetoken.quant import FORMATS, QuantTensor, format_for_gguf_type, get_format

T = GGMLQuantizationType


def test_names_are_keys() -> None:
    assert set(FORMATS) == {
        "f32",
        "f16",
        "bf16",
        "q8_0",
        "q8_0x8",
        "q4_0",
        "q5_0",
        "q4_k",
        "q5_k",
        "q6_k",
        "mxfp4",
        "fp8_block",
        "nvfp4",
    }
    assert all(fmt.name == name for name, fmt in FORMATS.items())


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown quant format 'q3' \(choose from f32, f16, "):
        get_format("q3")


@pytest.mark.parametrize(
    ("qtype", "name"),
    [
        (T.F32, "f32"),
        (T.F16, "f16"),
        (T.BF16, "bf16"),
        (T.Q8_0, "q8_0"),
        (T.Q4_0, "q4_0"),
        (T.Q5_0, "q5_0"),
        (T.Q4_K, "q4_k"),
        (T.Q5_K, "q5_k"),
        (T.Q6_K, "q6_k"),
        (T.MXFP4, "mxfp4"),
    ],
)
def test_gguf_type_lookup(qtype: GGMLQuantizationType, name: str) -> None:
    assert format_for_gguf_type(int(qtype)) is FORMATS[name]


def test_unsupported_gguf_type() -> None:
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor type IQ2_XXS \(supported: F32"):
        format_for_gguf_type(int(T.IQ2_XXS))
    with pytest.raises(ValueError, match="unsupported GGUF tensor type #999"):
        format_for_gguf_type(999)


@pytest.mark.parametrize("name", list(FORMATS))
def test_round_trip_contract(name: str) -> None:
    fmt = FORMATS[name]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    q = fmt.quantize(x)
    assert isinstance(q, QuantTensor) and q.fmt == name and q.shape == (3, 256)
    assert q.data.shape[-1] * q.data.element_size() == fmt.row_bytes(256)
    out = fmt.dequantize(q)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out - x).norm() / x.norm() < 0.15


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "bf16", "f16", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_as_equals_reference_then_cast(fmt, dtype, device):
    from freetoken.quant import dequantize_as

    torch.manual_seed(0)
    t = get_format(fmt).quantize(torch.randn(3, 16, 256) * 4)
    t = QuantTensor(t.fmt, t.shape, t.data.to(device),
                    {k: v.to(device) for k, v in t.scales.items()})
    want = get_format(fmt).dequantize(t).to(dtype)
    assert torch.equal(dequantize_as(t, dtype), want)
