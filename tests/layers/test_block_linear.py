"""Dense Q8_0 matrices kept as Q8_0x8 blocks on a GPU (``layers/block_linear.py``): the fused
kernel (Triton's interpreter on the CPU) against the gguf package's dequantisation, and a
model with its attention and head as blocks against the same model with bf16-style weights
dequantised at load (its slow twin)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.layers import linear
from freetoken.layers.block_linear import BlockLinear
from freetoken.quant import QuantTensor, get_format
from tests.models.helpers import load_ours, our_logits

pytest.importorskip("triton")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 3, 8, 11])
@pytest.mark.parametrize("reader", ["float", "sums", "int8_x"])
def test_a_block_layer_follows_gguf_dequantisation(device, T, reader, monkeypatch):
    """1-8 rows through the kernel (one read of W for all), more (prefill) dequantised; so
    with each block's products summed before its scale (Q8_0x8's ``sums`` launch choice), and
    with x as int8 blocks (``int8_x``: against gguf's weights times x as
    ``int8_x_reference`` rounds it, where the kernel runs)."""
    from freetoken.kernels import gather_gemv, gemv_launch

    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8", dataclasses.replace(
        gemv_launch.KERNELS["q8_0x8"], sums=reader == "sums", int8_x=reader == "int8_x"))
    g = torch.Generator().manual_seed(T)
    qt = get_format("q8_0").quantize(torch.randn(40, 512, generator=g))
    with torch.device(device):
        layer = BlockLinear(512, 40)
    layer.load_weight_tensor(QuantTensor("q8_0", qt.shape, qt.data.to(device)))
    x = torch.randn(T, 512, generator=g)
    got = layer(x.to(device)).cpu().double().numpy()
    w = dequantize(qt.data.numpy(), GGMLQuantizationType.Q8_0).reshape(40, 512)
    xs = x.double()
    if reader == "int8_x" and T <= gather_gemv.DENSE_TOKENS:
        q, d = gather_gemv.int8_x_reference(x)
        xs = (q.double().unflatten(-1, (-1, 32)) * d.double()[..., None]).flatten(-2)
    tol = 2e-2 if reader == "int8_x" and device == "cuda" else 1e-5  # a quotient's last bit
    np.testing.assert_allclose(got, xs.numpy() @ w.T.astype(np.float64), rtol=tol,
                               atol=tol * 10)


def test_a_block_layer_takes_only_its_q8_0_matrix():
    layer = BlockLinear(256, 8)
    with pytest.raises(ValueError, match="bf16 weight of shape"):
        layer.load_weight_tensor(get_format("bf16").quantize(torch.randn(8, 256)))
    assert layer.missing_weight()


def test_a_model_with_block_layers_follows_its_slow_twin(wide_qwen3_moe_q8, monkeypatch):
    """Attention's q/k/v (one stack), o and the head become blocks, the routers do not;
    prefill (dequantised) and decode (the kernel's float reader) within float32 rounding of
    the weights dequantised at load; the default reader (x as int8 blocks) within x's
    rounding."""
    from freetoken.kernels import gemv_launch

    monkeypatch.setattr(linear, "stacks", lambda weight: True)  # as on a GPU
    ids = [3, 17, 99, 5, 42, 7]
    want = our_logits(load_ours(wide_qwen3_moe_q8), ids, prefill=3)
    model = load_ours(wide_qwen3_moe_q8, dense_blocks=True)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.o_proj, BlockLinear) and isinstance(model.lm_head, BlockLinear)
    assert attn.qkv.dtype == torch.uint8 and attn.q_proj.blocks.data_ptr() == attn.qkv.data_ptr()
    assert not isinstance(model.model.layers[0].mlp.gate, BlockLinear)
    int8_x = our_logits(model, ids, prefill=3)
    assert (int8_x - want).norm() < 0.02 * want.norm()
    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8", dataclasses.replace(
        gemv_launch.KERNELS["q8_0x8"], int8_x=False))
    torch.testing.assert_close(our_logits(model, ids, prefill=3), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tok", [1, 8])
@pytest.mark.parametrize("int8_x", [False, True])
def test_the_dense_kernel_compiles_for_a_gpu(tok, int8_x):
    from freetoken.kernels.gemv_launch import KERNELS
    from tests.kernels.conftest import compile_for_sm90

    spec = KERNELS["q8_0x8"]
    sig = {"w_ptr": "*u8", "x_ptr": "*bf16", "out_ptr": "*bf16", "R": "i32", "T": "i32",
           "row_stride": "i32", "x_stride": "i32", "out_stride": "i32", "NB": "constexpr",
           "BLOCK_R": "constexpr", "STEP": "constexpr", "TOK": "constexpr", "BITS": "constexpr"}
    sig = {**sig, "SUMS": "constexpr", "INT8_X": "constexpr", "ASM": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_gemv", "dense_gemv", sig,
                     {"NB": 8, "BLOCK_R": spec.rows, "STEP": spec.step, "TOK": tok,
                      "BITS": spec.bits, "SUMS": tok == 8 and not int8_x, "INT8_X": int8_x,
                      "ASM": True}, pdl=tok == 1)
