"""The per-token step kernels against their slow twins: RMSNorm (``RMSNorm.reference``) in each
of its three scale orders, rotary (``Rotary.reference``), routing (``MoEBlock.choose``); on the
CPU through Triton's interpreter, on the GPU compiled."""

from __future__ import annotations

import os

import pytest
import torch

from freetoken.layers.norm import RMSNorm
from tests.kernels.conftest import compile_for_sm90

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
STEPS = "freetoken.kernels.triton_token_steps"


@pytest.fixture
def kernel(triton_runs):
    from freetoken.kernels.token_steps import rms_norm

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
    from freetoken.kernels.token_steps import rms_norm

    n = _norm(64, torch.float32, "cpu")
    x = torch.randn(5, 128)[:, :64]  # every row 128 apart
    torch.testing.assert_close(rms_norm(x, n.weight, n.eps, n.mode), n.reference(x))
    heads = torch.randn(3, 320)[:, 64:256].view(3, 3, 64)  # (T, heads, D) of a wider row
    torch.testing.assert_close(rms_norm(heads, n.weight, n.eps, n.mode), n.reference(heads))


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_kernel_compiles_for_a_gpu(dtype: str, mode: int) -> None:
    sig = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "dim": "i32", "heads": "i32",
           "x_tok": "i64", "x_head": "i64", "out_stride": "i64", "eps": "fp32",
           "MODE": "constexpr", "BLOCK": "constexpr"}
    compile_for_sm90(STEPS, "rms_norm", sig, {"MODE": mode, "BLOCK": 2048},
                     pdl=dtype == "*bf16")


@pytest.fixture
def rotary_kernel(triton_runs):
    from freetoken.kernels.token_steps import rotary

    return rotary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,heads,D", [(1, 4, 128), (5, 2, 64), (3, 1, 80)])
def test_rotary_kernel_follows_the_reference(rotary_kernel, device, dtype, T, heads, D):
    from freetoken.config import RopeSpec
    from freetoken.layers.rotary import Rotary

    torch.manual_seed(0)
    rope = Rotary(D, 10000.0, 64, spec=RopeSpec(150000.0, "yarn", 8.0, beta_fast=32.0,
                                               beta_slow=1.0, original_max_position=32,
                                               truncate=True)).to(device)
    x = torch.randn(T, heads, D).to(device, dtype)
    pos = torch.randint(0, 64, (T,)).to(device)
    want = rope.reference(x, pos)
    got = rotary_kernel(x, rope.cos, rope.sin, pos)
    if dtype is torch.float32 or device == "cuda":  # it rounds where torch rounds
        assert torch.equal(got, want)
    else:  # the interpreter truncates to bf16, at each of four roundings
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.03)


@pytest.mark.parametrize("dtype,rnd", [("*bf16", True), ("*fp32", False)])
def test_rotary_kernel_compiles_for_a_gpu(dtype: str, rnd: bool) -> None:
    sig = {"x_ptr": dtype, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
           "out_ptr": dtype, "heads": "i32", "x_tok": "i64", "x_head": "i64", "out_tok": "i64",
           "HALF": "constexpr", "BLOCK": "constexpr", "ROUND": "constexpr"}
    compile_for_sm90(STEPS, "rotary_neox", sig, {"HALF": 64, "BLOCK": 64, "ROUND": rnd},
                     pdl=dtype == "*bf16")


@pytest.fixture
def norm_rotary_kernel(triton_runs):
    from freetoken.kernels.token_steps import norm_rotary

    return norm_rotary


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"unit_offset": True}])
@pytest.mark.parametrize("T,n_q,n_kv,D", [(1, 4, 2, 128), (3, 2, 1, 64)])
def test_norm_and_rotary_in_one_kernel_follow_the_four(norm_rotary_kernel, device, dtype, kw,
                                                       T, n_q, n_kv, D):
    """q and k heads of one qkv row (v's after them is not read) normalised by q_norm's and
    k_norm's weights, then rotated, against the four kernels one after another: float32 to its
    rounding (the sums of squares may round apart), bf16 within a step of it."""
    from freetoken.kernels.token_steps import rms_norm, rotary
    from freetoken.layers.rotary import Rotary

    torch.manual_seed(1)
    rope = Rotary(D, 10000.0, 64).to(device)
    qn, kn = _norm(D, dtype, device, **kw), _norm(D, dtype, device, **kw)
    kn.weight.data = kn.weight.data.flip(0)
    qkv = (torch.randn(T, (n_q + 2 * n_kv) * D) * 3).to(device, dtype)
    qk = qkv[:, :(n_q + n_kv) * D].view(T, n_q + n_kv, D)
    pos = torch.randint(0, 64, (T,)).to(device)
    q, k = norm_rotary_kernel(qk, n_q, qn.weight, kn.weight, qn.eps, qn.mode, rope.cos, rope.sin,
                              pos)
    want_q = rotary(rms_norm(qk[:, :n_q], qn.weight, qn.eps, qn.mode), rope.cos, rope.sin, pos)
    want_k = rotary(rms_norm(qk[:, n_q:], kn.weight, kn.eps, kn.mode), rope.cos, rope.sin, pos)
    for got, want in ((q, want_q), (k, want_k)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype is torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            step = want.float().abs().clamp(min=1e-2) * 2 ** -6
            assert ((got.float() - want.float()).abs() <= 2 * step).all()


@pytest.mark.parametrize("dtype,rnd", [("*bf16", True), ("*fp32", False)])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_norm_rotary_kernel_compiles_for_a_gpu(dtype: str, rnd: bool, mode: int) -> None:
    sig = {"x_ptr": dtype, "qw_ptr": dtype, "kw_ptr": dtype, "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "pos_ptr": "*i64", "q_ptr": dtype, "k_ptr": dtype, "n_q": "i32",
           "x_tok": "i64", "q_tok": "i64", "k_tok": "i64", "eps": "fp32", "MODE": "constexpr",
           "HALF": "constexpr", "BLOCK": "constexpr", "ROUND": "constexpr"}
    compile_for_sm90(STEPS, "norm_rotary", sig, {"MODE": mode, "HALF": 64, "BLOCK": 64,
                                                 "ROUND": rnd},
                     pdl=dtype == "*bf16")


@pytest.fixture
def route_kernel(triton_runs):
    from freetoken.kernels.token_steps import route

    return route


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k", [(128, 8), (60, 4), (8, 2)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_follows_the_torch_router(route_kernel, device, E, k, norm, dtype):
    from freetoken.models.blocks import MoEBlock

    torch.manual_seed(0)
    logits = (torch.randn(6, E) * 2).to(device, dtype)
    block = MoEBlock.__new__(MoEBlock)
    block.top_k, block.norm_topk_prob = k, norm
    want_ids, want_w = block.choose(logits, dtype)
    ids, w = route_kernel(logits, k, norm, dtype)
    assert ids.dtype == torch.int64 and w.dtype == dtype
    if dtype is torch.float32:  # random float32 logits: no ties
        assert torch.equal(ids, want_ids)
    else:  # bf16 logits tie for real: the same logits chosen, maybe other ids of a tie
        assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    tol = 1e-6 if dtype is torch.float32 else 1e-2
    torch.testing.assert_close(w, want_w, rtol=tol, atol=tol)


def test_routing_kernel_takes_the_lower_id_on_a_tie():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on the CPU")
    from freetoken.kernels.token_steps import route

    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]])
    ids, w = route(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 3, 4]]
    torch.testing.assert_close(w.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_routing_kernel_compiles_for_a_gpu(dtype: str) -> None:
    sig = {"logits_ptr": dtype, "ids_ptr": "*i64", "w_ptr": dtype, "E": "i32", "stride": "i64",
           "K": "constexpr", "KB": "constexpr", "BLOCK": "constexpr", "NORM": "constexpr"}
    compile_for_sm90(STEPS, "route_topk", sig, {"K": 8, "KB": 8, "BLOCK": 128, "NORM": True},
                     pdl=dtype == "*bf16")


@pytest.fixture
def router_kernel(triton_runs):
    from freetoken.kernels.token_steps import route_from_hidden

    return route_from_hidden


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,H,E,k", [(1, 2048, 128, 8), (3, 96, 60, 4), (8, 64, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_and_routing_in_one_kernel_follow_the_matmul(router_kernel, device, T, H,
                                                                 E, k, dtype):
    """``route_from_hidden`` against the router's matmul then ``MoEBlock.choose``: the same
    experts (float32 logits do not tie; in bf16 the chosen logits are the twin's to one bf16
    step, the sums run in another order), their weights to rounding; the counters are back
    at 0 after each launch, so a second launch gives the same."""
    from freetoken.kernels.token_steps import _COUNTS
    from freetoken.models.blocks import MoEBlock

    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    gate = (torch.randn(E, H, generator=g) / H ** 0.5 * 3).to(device, dtype)
    block = MoEBlock.__new__(MoEBlock)
    block.top_k, block.norm_topk_prob = k, True
    logits = torch.nn.functional.linear(x, gate)
    want_ids, want_w = block.choose(logits, dtype)
    ids, w = router_kernel(x, gate, k, True, dtype)
    assert ids.dtype == torch.int64 and w.dtype == dtype and ids.shape == (T, k)
    if dtype is torch.float32:
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-5)
    else:
        chosen, wanted = logits.gather(1, ids).float(), logits.gather(1, want_ids).float()
        torch.testing.assert_close(chosen, wanted, rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(w.float(), want_w.float(), rtol=3e-2, atol=3e-2)
    assert _COUNTS and not any(c.any() for c in _COUNTS.values())
    again = router_kernel(x, gate, k, True, dtype)
    assert torch.equal(again[0], ids) and torch.equal(again[1], w)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_the_router_kernel_compiles_for_a_gpu(dtype: str) -> None:
    sig = {"x_ptr": dtype, "g_ptr": dtype, "logits_ptr": "*fp32", "count_ptr": "*i32",
           "ids_ptr": "*i64", "w_ptr": dtype, "H": "i32", "E": "i32", "x_stride": "i64",
           "K": "constexpr", "KB": "constexpr", "BLOCK": "constexpr", "ROWS": "constexpr",
           "BLOCK_H": "constexpr", "NORM": "constexpr"}
    compile_for_sm90(STEPS, "route_hidden", sig, {"K": 8, "KB": 8, "BLOCK": 128, "ROWS": 4,
                                                  "BLOCK_H": 512, "NORM": True},
                     pdl=dtype == "*bf16")


@pytest.fixture
def add_norm_kernel(triton_runs):
    from freetoken.kernels.token_steps import add_rms_norm

    return add_rms_norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [{}, {"unit_offset": True}, {"float_scale": True}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_and_norm_in_one_kernel_follow_the_two(add_norm_kernel, device, kw,
                                                            dtype):
    """h = x + a as torch adds, then the RMSNorm kernel's result on h."""
    from freetoken.kernels.token_steps import rms_norm

    n = _norm(256, dtype, device, **kw)
    x, a = ((torch.randn(3, 256) * 3).to(device, dtype) for _ in range(2))
    h, got = add_norm_kernel(x, a, n.weight, n.eps, n.mode)
    if dtype is torch.float32 or device == "cuda":  # the interpreter rounds to bf16 its way
        assert torch.equal(h, x + a)
    else:
        torch.testing.assert_close(h.float(), (x + a).float(), atol=0.1, rtol=2 ** -7)
    want = rms_norm(h, n.weight, n.eps, n.mode)
    if dtype is torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        step = want.float().abs().clamp(min=1e-3) * 2 ** -6
        assert ((got.float() - want.float()).abs() <= step).all()
    assert n.added(x, None)[0] is x


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_add_norm_kernel_compiles_for_a_gpu(dtype: str, mode: int) -> None:
    sig = {"x_ptr": dtype, "a_ptr": dtype, "w_ptr": dtype, "h_ptr": dtype, "out_ptr": dtype,
           "dim": "i32", "x_stride": "i64", "a_stride": "i64", "h_stride": "i64",
           "out_stride": "i64", "eps": "fp32", "MODE": "constexpr", "BLOCK": "constexpr"}
    compile_for_sm90(STEPS, "add_rms_norm", sig, {"MODE": mode, "BLOCK": 2048},
                     pdl=dtype == "*bf16")
