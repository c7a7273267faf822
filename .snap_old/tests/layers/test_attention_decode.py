"""The native decode attention against its slow twin, torch's SDPA over the gathered cache."""

from __future__ import annotations

import pytest
import torch

from freetoken.kvcache.paged import PagedKV
from freetoken.layers import attention as attn_mod
from freetoken.layers.context import ForwardContext, Segment


def _torch_path(monkeypatch, *args):
    monkeypatch.setattr(attn_mod, "_native_decode", lambda: None)
    out = attn_mod.attention(*args)
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("sharp", [1.0, 30.0])  # 30: scores spread over ~100, exp underflows
@pytest.mark.parametrize(("heads", "kv_heads", "window", "D"), [
    (8, 2, 0, 64), (4, 4, 0, 64), (8, 1, 5, 64),
    (20, 2, 0, 32),  # ten query heads per kv head: a block of eight and a block of two
    (6, 2, 0, 40),  # a head size that is not a multiple of 16: the plain loops
])
def test_native_decode_matches_sdpa(monkeypatch, heads, kv_heads, window, D, sharp):
    if attn_mod._native_decode() is None:
        pytest.skip("the native library is not built")
    torch.manual_seed(0)
    page = 4
    kv = PagedKV(num_layers=2, num_pages=16, page_size=page, kv_heads=kv_heads, head_dim=D,
                 dtype=torch.float32, device="cpu")
    kv.k.normal_()
    kv.v.normal_()
    # three sequences at different lengths, pages interleaved in the pool
    segs = [Segment(pages=kv.allocate(3), start=9, count=1),
            Segment(pages=kv.allocate(1), start=0, count=1),
            Segment(pages=kv.allocate(2), start=6, count=1)]
    ctx = ForwardContext.build(kv, segs, torch.device("cpu"), windows=(window,))
    assert ctx.decode
    q, k, v = (torch.randn(3, h, D) for h in (heads, kv_heads, kv_heads))
    q = q * sharp
    before = kv.k.clone(), kv.v.clone()
    with monkeypatch.context() as m:  # the native path must be the one that runs
        m.setattr(attn_mod.F, "scaled_dot_product_attention", None)
        got = attn_mod.attention(q, k, v, ctx, 1, D**-0.5, window)  # stores k, v natively
    stored = kv.k.clone(), kv.v.clone()
    kv.k.copy_(before[0])
    kv.v.copy_(before[1])
    want = _torch_path(monkeypatch, q, k, v, ctx, 1, D**-0.5, window)
    # scores spread over ~100 turn a score's last-bit rounding (the sums run in another order
    # than SDPA's) into ~1e-5 of its weight
    tol = dict(atol=2e-6, rtol=2e-5) if sharp == 1 else dict(atol=2e-5, rtol=1e-3)
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(stored[0], kv.k) and torch.equal(stored[1], kv.v)
    assert not torch.equal(stored[0], before[0])  # the new keys did land


@pytest.mark.parametrize("window", [0, 5])
def test_a_prefill_batch_gives_each_sequence_its_solo_bits(window):
    """Three prompts prefilled in one forward (padded to the longest in torch's batch) against
    each prefilled alone: the same bits on the CPU, so a request answers the same with company
    as alone (int8-rounded activations downstream turn a 3e-5 difference into another token)."""
    torch.manual_seed(0)
    Hq, Hkv, D, page = 8, 2, 32, 4
    lengths = [7, 13, 3]
    q = torch.randn(sum(lengths), Hq, D)
    k, v = torch.randn(sum(lengths), Hkv, D), torch.randn(sum(lengths), Hkv, D)
    windows = (0, window) if window else (0,)

    def run(which: list[int]) -> list[torch.Tensor]:
        kv = PagedKV(1, 16, page, Hkv, D, torch.float32, "cpu")
        segs, rows = [], []
        for i in which:
            segs.append(Segment(kv.allocate(-(-lengths[i] // page)), 0, lengths[i]))
            first = sum(lengths[:i])
            rows.append(torch.arange(first, first + lengths[i]))
        idx = torch.cat(rows)
        ctx = ForwardContext.build(kv, segs, torch.device("cpu"), windows)
        out = attn_mod.attention(q[idx], k[idx], v[idx], ctx, 0, D**-0.5, window)
        return list(out.split([lengths[i] for i in which]))

    together = run([0, 1, 2])
    for i in range(3):
        assert torch.equal(together[i], run([i])[0])
