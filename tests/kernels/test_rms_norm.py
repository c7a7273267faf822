"""The fused RMSNorm kernel against its slow twin (``RMSNorm.reference``) in each of its three
scale orders; on the CPU through Triton's interpreter, on the GPU compiled."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from freetoken.layers.norm import RMSNorm

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def kernel(request):
    if request.node.callspec.params["device"] == "cpu" and os.environ.get(
            "TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton kernels need a GPU; without one tests/conftest.py "
                    "selects the interpreter")
    from freetoken.kernels.rms_norm import rms_norm

    return rms_norm


def _norm(dim: int, dtype: torch.dtype, device: str, **kw) -> RMSNorm:
    torch.manual_seed(0)
    n = RMSNorm(dim, 1e-6, **kw)
    n.weight.data = (torch.randn(dim) * 0.5 + (0.0 if kw.get("unit_offset") else 1.0)).to(
        device, dtype)
    return n


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [{}, {"unit_offset": True}, {"float_scale": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 96), (2, 4, 128), (1, 2048)])
def test_kernel_follows_the_reference(kernel, device, kw, dtype, shape):
    n = _norm(shape[-1], dtype, device, **kw)
    x = (torch.randn(shape) * 3).to(device, dtype)
    want = n.reference(x)
    got = kernel(x, n.weight, n.eps, n.mode)
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:  # two bf16 steps apart at most (two roundings; the interpreter truncates to bf16)
        step = want.float().abs().clamp(min=1e-3) * 2 ** -6
        assert ((got.float() - want.float()).abs() <= step).all()
        if device == "cuda":  # compiled, it rounds to nearest: nearly every value agrees
            assert (got == want).float().mean() > 0.95


def test_rows_with_a_stride_are_read_as_rows(kernel=None):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on the CPU")
    from freetoken.kernels.rms_norm import rms_norm

    n = _norm(64, torch.float32, "cpu")
    x = torch.randn(5, 128)[:, :64]  # every row 128 apart
    torch.testing.assert_close(rms_norm(x, n.weight, n.eps, n.mode), n.reference(x))


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from freetoken.kernels import triton_norm
dtype, mode = sys.argv[1], int(sys.argv[2])
sig = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "dim": "i32", "x_stride": "i64",
       "out_stride": "i64", "eps": "fp32", "MODE": "constexpr", "BLOCK": "constexpr"}
src = ASTSource(fn=triton_norm.rms_norm, signature=sig, constexprs={"MODE": mode, "BLOCK": 2048})
assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"], "no cubin"
"""


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_kernel_compiles_for_a_gpu(dtype: str, mode: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, dtype, str(mode)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
