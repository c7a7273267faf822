"""The decode attention kernel against the torch path it replaces (keys and values gathered
into a padded batch, SDPA with the mask), on scrambled pages, GQA, full and sliding windows;
on the CPU through Triton's interpreter, on the GPU compiled."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from freetoken.kvcache.paged import PagedKV
from freetoken.layers.attention import _gather
from freetoken.layers.context import ForwardContext, Segment
from tests.kernels.conftest import compile_for_sm90

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture
def kernel(triton_runs):
    from freetoken.kernels.paged_attention import decode_attention

    return decode_attention


def _torch_path(q, kv, ctx, window, scale):
    keys = _gather(kv.k[0], ctx.k_slots).transpose(1, 2)
    values = _gather(kv.v[0], ctx.k_slots).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                         attn_mask=ctx.masks[window], scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[1])
    return out.squeeze(2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("Hq,Hkv,D", [(8, 2, 64), (4, 4, 32), (6, 2, 80)])
def test_kernel_follows_the_torch_path(kernel, device, dtype, window, Hq, Hkv, D):
    torch.manual_seed(0)
    page = 4
    kv = PagedKV(1, 64, page, Hkv, D, dtype, device)
    kv.k.normal_()
    kv.v.normal_()
    lengths = [1, 7, 70, 130]  # one key; under a window; several loop steps
    pages = kv.allocate(kv.num_pages)
    order = torch.randperm(len(pages)).tolist()
    segs, used = [], 0
    for n in lengths:
        need = -(-n // page)
        segs.append(Segment([pages[i] for i in order[used:used + need]], n - 1, 1))
        used += need
    ctx = ForwardContext.build(kv, segs, torch.device(device), (window,))
    q = torch.randn(len(lengths), Hq, D).to(device, dtype)
    k = torch.randn(len(lengths), Hkv, D).to(device, dtype)
    v = torch.randn(len(lengths), 3 * Hkv * D).to(device, dtype)[:, D:D + Hkv * D].view(
        len(lengths), Hkv, D)  # a slice of a wider row, as from a fused projection
    scale = D ** -0.5
    theirs = PagedKV(1, 64, page, Hkv, D, dtype, device)
    theirs.k.copy_(kv.k)
    theirs.v.copy_(kv.v)
    theirs.store(0, ctx.slots, k, v)
    want = _torch_path(q, theirs, ctx, window, scale)
    got = kernel(q, k, v, ctx.slots, kv.k[0], kv.v[0], ctx.k_slots, ctx.positions, scale,
                 window)
    assert torch.equal(kv.k, theirs.k) and torch.equal(kv.v, theirs.v)  # stored as torch does
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernel_compiles_for_a_gpu(dtype: str) -> None:
    sig = {"q_ptr": dtype, "k_ptr": dtype, "v_ptr": dtype, "slots_ptr": "*i64",
           "pos_ptr": "*i64", "out_ptr": dtype, "q_tok": "i64", "q_head": "i64",
           "kv_slot": "i64", "kv_head": "i64", "slots_row": "i64", "out_tok": "i64",
           "out_head": "i64", "scale": "fp32", "window": "i32", "k_new_ptr": dtype,
           "v_new_ptr": dtype, "new_slot_ptr": "*i64", "k_tok": "i64", "k_head": "i64",
           "v_tok": "i64", "v_head": "i64", "GROUP": "constexpr", "GP": "constexpr",
           "D": "constexpr", "DP": "constexpr", "BLOCK_S": "constexpr", "MMA": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_attention", "decode_attention", sig,
                     {"GROUP": 8, "GP": 16, "D": 128, "DP": 128, "BLOCK_S": 64,
                      "MMA": dtype != "*fp32"},
                     pdl=dtype == "*bf16")


def test_a_model_decodes_through_it(tiny_qwen3_moe, monkeypatch):
    """Dispatched from the attention layer at decode (the interpreter standing in for the
    GPU): logits follow the torch path's; prefill stays on the torch path."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on the CPU")
    from freetoken.kernels import paged_attention
    from freetoken.layers import attention
    from tests.models.helpers import load_ours, our_logits

    monkeypatch.setattr(attention, "_native_decode", lambda: None)  # the CPU's own kernel
    ids = [3, 17, 99, 5, 42, 42, 7, 128, 64, 1]
    model = load_ours(tiny_qwen3_moe)
    want = our_logits(model, ids, prefill=4)
    calls = []

    def on_cpu(q, k, v, k_cache, positions):
        calls.append(q.shape[0])
        return q.dim() == 3 and q.shape[2] == k_cache.shape[2]

    monkeypatch.setattr(paged_attention, "usable", on_cpu)
    got = our_logits(model, ids, prefill=4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == 6 * model.config.num_layers  # the six decode steps, every layer
