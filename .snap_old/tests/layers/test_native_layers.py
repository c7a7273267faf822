"""The CPU's native RMSNorm and rotary embedding against transformers' modules and against
their torch slow twins (RMSNorm.reference, Rotary.reference)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeRMSNorm,
    apply_rotary_pos_emb,
)

from freetoken.layers import norm as norm_mod
from freetoken.layers import rotary as rotary_mod
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rotary import Rotary

pytestmark = pytest.mark.skipif(norm_mod._native() is None,
                                reason="the native library is not built")


def _no_slow_twin(monkeypatch, cls, name):
    """Make ``cls.name`` (a torch slow twin) raise, so a passing call ran the native path."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"{cls.__name__}.{name} ran instead of the native path")
    monkeypatch.setattr(cls, name, refuse)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 32, 128), (5, 37), (2, 2880)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_transformers(shape, gemma, monkeypatch):
    torch.manual_seed(0)
    dim, eps = shape[-1], 1e-6
    theirs = Gemma3RMSNorm(dim, eps) if gemma else Qwen3MoeRMSNorm(dim, eps)
    ours = RMSNorm(dim, eps, unit_offset=gemma)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
    x = torch.randn(shape) * 3
    slow = ours.reference(x)
    _no_slow_twin(monkeypatch, RMSNorm, "reference")
    got = ours(x)
    torch.testing.assert_close(got, theirs(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, slow, atol=1e-6, rtol=1e-5)


def test_rms_norm_reads_strided_input():
    torch.manual_seed(1)
    ours = RMSNorm(64, 1e-5)
    ours.weight.data.normal_()
    x = torch.randn(64, 6).t()  # (6, 64), not contiguous
    torch.testing.assert_close(ours(x), ours.reference(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("T", "heads", "D"), [(1, 32, 128), (7, 4, 64), (3, 2, 10)])
def test_rotary_matches_transformers_bit_for_bit(T, heads, D, monkeypatch):
    torch.manual_seed(2)
    rot = Rotary(D, 1e6, 512)
    positions = torch.randint(0, 512, (T,))
    x = torch.randn(T, heads, D)
    slow = rot.reference(x, positions)
    _no_slow_twin(monkeypatch, Rotary, "reference")
    got = rot(x, positions.int())  # int32 positions are widened
    assert torch.equal(got, slow)
    cos, sin = rot.cos[positions, 0][None], rot.sin[positions, 0][None]  # (1, T, D)
    q = x.transpose(0, 1)[None]  # (1, heads, T, D)
    want, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=0, rtol=0)


def test_rotary_position_past_the_table_is_an_index_error():
    rot = Rotary(16, 1e4, 8)
    with pytest.raises(IndexError):
        rot(torch.randn(1, 2, 16), torch.tensor([8]))


def test_slow_twins_run_without_the_library(monkeypatch):
    monkeypatch.setattr(norm_mod, "_native", lambda: None)
    monkeypatch.setattr(rotary_mod, "_native", lambda: None)
    norm, rot = RMSNorm(8, 1e-6), Rotary(8, 1e4, 4)
    norm.weight.data.fill_(2.0)
    x = torch.randn(2, 8)
    assert torch.equal(norm(x), norm.reference(x))
    pos = torch.tensor([1, 3])
    assert torch.equal(rot(x[:, None], pos), rot.reference(x[:, None], pos))


@pytest.mark.parametrize("renormalise", [True, False])
def test_router_top_k_matches_torch(renormalise, monkeypatch):
    from freetoken.config import ModelConfig
    from freetoken.models.blocks import MoEBlock

    cfg = ModelConfig(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position=64, tie_word_embeddings=False,
                      num_experts=128, top_k=8, moe_intermediate_size=32, moe_layers=(True,),
                      norm_topk_prob=renormalise)
    block = MoEBlock(cfg, 0, "resident")
    torch.manual_seed(3)
    block.gate.weight.data.normal_()
    x = torch.randn(5, 64)
    slow_ids, slow_w = block.choose(block.gate(x), x.dtype)
    _no_slow_twin(monkeypatch, MoEBlock, "choose")
    ids, weights = block.route(x)
    # transformers' Qwen3-MoE router: softmax in float32, top-k, renormalised if configured
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1, dtype=torch.float32)
    want_w, want_ids = torch.topk(probs, 8, dim=-1)
    if renormalise:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-7, rtol=1e-5)
    assert torch.equal(ids, slow_ids)
    torch.testing.assert_close(weights, slow_w, atol=1e-7, rtol=1e-5)


def test_router_ties_go_to_the_lower_expert():
    from freetoken.models.blocks import _native_route

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0]])
    ids, w = torch.empty(1, 3, dtype=torch.int64), torch.empty(1, 3)
    _native_route()(logits.data_ptr(), 1, 6, 3, True, ids.data_ptr(), w.data_ptr())
    assert ids.tolist() == [[1, 3, 2]]
    e = torch.tensor([2.0, 2.0, 1.0]).exp()
    torch.testing.assert_close(w, (e / e.sum())[None])


def test_router_ranks_nan_first_as_torch_does():
    from freetoken.models.blocks import _native_route

    logits = torch.tensor([[1.0, 2.0, float("nan"), 3.0, 0.0]])
    ids, w = torch.empty(1, 3, dtype=torch.int64), torch.empty(1, 3)
    _native_route()(logits.data_ptr(), 1, 5, 3, True, ids.data_ptr(), w.data_ptr())
    assert ids.tolist() == torch.topk(logits, 3).indices.tolist() == [[2, 3, 1]]


def test_native_paths_refuse_shapes_they_do_not_fit():
    """A wrong shape reaches the torch path, which raises, instead of reading past a table."""
    with pytest.raises(RuntimeError):
        Rotary(16, 1e4, 8)(torch.randn(1, 2, 32), torch.tensor([7]))
    with pytest.raises(RuntimeError):
        RMSNorm(8, 1e-6)(torch.randn(2, 16))
