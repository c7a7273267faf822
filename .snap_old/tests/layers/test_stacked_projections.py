"""q, k and v as one matmul over a stacked weight (what a GPU gets), against three."""

from __future__ import annotations

import torch

from freetoken.layers import linear
from tests.models.helpers import load_ours, our_logits

IDS = [3, 17, 99, 5, 42, 42, 7, 128, 64, 1]


def test_one_stacked_matmul_follows_three(tiny_qwen3_moe, monkeypatch):
    want = our_logits(load_ours(tiny_qwen3_moe), IDS, prefill=4)
    monkeypatch.setattr(linear, "stacks", lambda weight: True)
    model = load_ours(tiny_qwen3_moe)
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None
    # the loader filled the stacked weight through the three views
    rows = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert torch.equal(attn.qkv, torch.cat(rows))
    assert all(w.untyped_storage().data_ptr() == attn.qkv.untyped_storage().data_ptr()
               for w in rows)
    torch.testing.assert_close(our_logits(model, IDS, prefill=4), want, rtol=1e-5, atol=1e-5)


def test_layers_with_a_bias_are_not_stacked(monkeypatch):
    monkeypatch.setattr(linear, "stacks", lambda weight: True)
    a, b = linear.Linear(8, 4, bias=True), linear.Linear(8, 4)
    assert linear.stack_rows([a, b]) is None and a.weight.shape == (4, 8)
