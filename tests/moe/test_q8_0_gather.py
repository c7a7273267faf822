"""The fused Q8_0 gather-GEMV kernel against the gguf package's dequantisation (float64 math)
and against its slow twin; on the CPU through Triton's interpreter, on the GPU compiled."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.quant import QuantTensor, get_format

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def kernels(request, monkeypatch):
    """The kernel module, built for the device under test (the interpreter on the CPU)."""
    from freetoken.kernels import q8_0_gather

    if request.node.callspec.params["device"] == "cpu" and os.environ.get(
            "TRITON_INTERPRET") != "1":
        pytest.skip("compiled Triton kernels need a GPU; without one tests/conftest.py "
                    "selects the interpreter")
    monkeypatch.setattr(q8_0_gather, "_kernel", None)
    return q8_0_gather


def _pool(slots: int, shapes: list[tuple[int, int]], seed: int,
          device: str = "cpu") -> list[torch.Tensor]:
    """Byte rows holding ``slots`` experts of Q8_0 projections back to back (one slot per row,
    as in the expert cache), and each projection's (S, R, K // 32 * 34) view of them."""
    g = torch.Generator().manual_seed(seed)
    fmt = get_format("q8_0")
    parts = [[fmt.quantize(torch.randn(r, k, generator=g)).data.reshape(-1)
              for (r, k) in shapes] for _ in range(slots)]
    rows = torch.stack([torch.cat(p) for p in parts]).to(device)
    views, offset = [], 0
    for r, k in shapes:
        n = r * k // 32 * 34
        views.append(rows[:, offset:offset + n].view(slots, r, k // 32 * 34))
        offset += n
    return views


def _gguf_weights(view: torch.Tensor, slot: int) -> np.ndarray:
    r, row_bytes = view.shape[1:]
    raw = view[slot].contiguous().numpy()
    return dequantize(raw, GGMLQuantizationType.Q8_0).reshape(r, row_bytes // 34 * 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R,K,T,A", [(40, 96, 1, 3), (17, 288, 2, 2), (96, 32, 3, 1)])
def test_gemv_matches_gguf_dequantisation(kernels, device, R, K, T, A):
    """Odd row counts (a partial row block) and block counts (a partial step), several tokens
    and pairs per token, slots read in place from strided rows with a projection offset."""
    _, view = _pool(4, [(8, 64), (R, K)], seed=R, device=device)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(T, K, generator=g)
    index = torch.randint(0, 4, (T * A,), generator=g)
    out = kernels.q8_0_gather_gemv(view, index.to(device), x.to(device), A).cpu()
    want = np.stack([_gguf_weights(view.cpu(), int(s)).astype(np.float64)
                     @ x[p // A].double().numpy() for p, s in enumerate(index)])
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_experts_match_the_slow_twin(kernels, device, dtype):
    """gate/up -> silu -> down, weighted and summed per token, as the dequantise + matmul path
    computes it; pairs whose weight is 0 (masked by the slot table) add nothing."""
    H, I_ = 96, 64
    qts = [QuantTensor("q8_0", (5, v.shape[1], v.shape[2] // 34 * 32), v, {})
           for v in _pool(5, [(I_, H), (I_, H), (H, I_)], seed=3, device=device)]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, H, generator=g).to(device, dtype)
    w = torch.rand(2, 3, generator=g)
    w[1, 2] = 0.0
    index = torch.tensor([0, 4, 2, 2, 1, 3]).to(device)
    act = torch.nn.functional.silu
    fused = kernels.gathered_q8_0(x, w.to(device), index, *qts, act)
    slow = kernels.gathered_q8_0_reference(x, w.to(device), index, *qts, act)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.float(), slow.float(), rtol=tol, atol=tol * slow.abs().max())


def test_misaligned_data_is_refused():
    from freetoken.kernels.q8_0_gather import q8_0_gather_gemv

    rows = torch.zeros(2, 2 * 34 + 1, dtype=torch.uint8)
    odd = rows[:, 1:].view(2, 1, 68)  # scales at odd byte addresses
    with pytest.raises(ValueError, match="2-byte aligned"):
        q8_0_gather_gemv(odd, torch.zeros(1, dtype=torch.long), torch.zeros(1, 64), 1)
