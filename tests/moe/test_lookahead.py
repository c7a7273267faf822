"""Look-ahead: the next layer's router on this layer's input, its predicted experts fetched
early; outputs are those of offload without it, bit for bit, and the prediction beats chance
by far on a synthetic checkpoint whose residual stream moves as a trained model's does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.moe.hybrid import HybridExperts
from freetoken.moe.lookahead import Lookahead, router_of
from freetoken.moe.offload import OffloadExperts, offload_stats
from freetoken.moe.slot_pool import rank
from freetoken.moe.split import SplitPolicy
from tests.models.helpers import load_ours, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180, 2, 33, 101, 8, 19, 240]


@pytest.fixture(scope="module")
def synth_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ft synth``'s tiny preset at 6 layers of 32 q8_0 experts (top-2), default router."""
    from freetoken.cli import main

    out = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    assert main(["synth", "--preset", "tiny", "--layers", "6", "--experts", "32",
                 "--expert-format", "q8_0", "--out", str(out)]) == 0
    return out


def test_each_cached_layer_predicts_with_the_next_moe_layers_router(tiny_qwen3_moe):
    """Layer 1 of the tiny model is dense: layer 0 predicts for layer 2, with its router."""
    model = load_ours(tiny_qwen3_moe, strategy="offload", cache=CacheSizing("size", 4))
    blocks = {m.experts.shape.layer: m for m in model.modules()
              if isinstance(getattr(m, "experts", None), OffloadExperts)}
    assert sorted(blocks) == [0, 2]
    la = blocks[0].experts.lookahead
    assert la is not None and la.layer == 2 and la.target is blocks[2].experts
    assert torch.equal(la.weight, router_of(blocks[2]).weight.float())
    assert blocks[2].experts.lookahead is None  # no MoE layer after it
    off = load_ours(tiny_qwen3_moe, strategy="offload", cache=CacheSizing("size", 4),
                    lookahead="off")
    assert all(m.lookahead is None for m in off.modules() if isinstance(m, OffloadExperts))
    for mode in ("auto", "on"):  # hybrid layers predict too
        on = load_ours(tiny_qwen3_moe, strategy="hybrid", cache=CacheSizing("size", 4),
                       lookahead=mode)
        linked = [m.lookahead for m in on.modules()
                  if isinstance(m, OffloadExperts) and m.lookahead is not None]
        assert len(linked) == 1 and isinstance(linked[0].target, HybridExperts)


@pytest.mark.parametrize("fraction", [1.0, 0.0])
def test_hybrid_fetching_every_miss_gets_offloads_lookahead(tiny_qwen3_moe, tmp_path,
                                                           fraction):
    """Under --moe-lookahead auto a hybrid layer whose split fetches every miss is offload:
    the layer before predicts for it, and the logits are offload's, bit for bit. While its
    split sends every miss to the CPU (a fixed share of 0), look-ahead still fetches 40 % of
    the predicted misses, and the CPU computes the rest."""
    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q8.gguf",
                           lambda n, s: "q8_0" if ".experts." in n else "f32")
    runs = {}
    for strategy in ("offload", "hybrid"):
        model = load_ours(path, strategy=strategy, cache=CacheSizing("size", 4))
        for m in model.modules():
            if isinstance(m, HybridExperts):
                m.policy = SplitPolicy(fraction, None, online=False)
        runs[strategy] = our_logits(model, IDS, prefill=1), offload_stats(model)
    needed = runs["hybrid"][1]["layers"]["2"]["lookahead_needed"]
    if fraction == 1.0:
        assert torch.equal(runs["hybrid"][0], runs["offload"][0])
        assert needed == runs["offload"][1]["layers"]["2"]["lookahead_needed"] > 0
        assert runs["hybrid"][1]["layers"]["2"]["prefetched"] > 0
    else:
        layer = runs["hybrid"][1]["layers"]["2"]
        assert needed > 0 and layer["prefetched"] > 0 and layer["cpu_experts"] > 0


def test_prediction_orders_experts_by_how_many_tokens_pick_them():
    w = torch.eye(4)  # expert e's logit is x[e]
    la = Lookahead(1, w, None, 2, None)
    x = torch.tensor([[0.0, 3.0, 2.0, 0.0], [0.0, 1.0, 0.0, 5.0], [4.0, 3.0, 0.0, 0.0]])
    # tokens pick {1, 2}, {3, 1}, {0, 1}: expert 1 thrice, then 0, 2, 3 once (lower id first)
    assert rank(la.route(x).numpy().ravel()) == [1, 0, 2, 3]
    assert la.budget(1) == 2 and la.budget(3) == 6 and la.budget(17) == 0


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_lookahead_changes_no_output(tiny_qwen3_moe, tmp_path, strategy):
    """Offload gives the same logits with look-ahead on and off: predicted experts only
    arrive earlier. Hybrid's CPU computes an expert with int8 activations, the device's path
    without, so an expert look-ahead moves from the CPU share into the cache changes its
    bits: close, not equal."""
    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q8.gguf",
                           lambda n, s: "q8_0" if ".experts." in n else "f32")
    runs = {}
    for on in (True, False):
        model = load_ours(path, strategy=strategy, cache=CacheSizing("size", 4),
                          lookahead="on" if on else "off", online=False)
        for m in model.modules():  # hybrid: half the misses fetched, as a profile row says
            if isinstance(m, HybridExperts):
                m.policy.fraction, m.policy.max_fetch = 0.5, None
        runs[on] = our_logits(model, IDS, prefill=1), offload_stats(model)
    if strategy == "offload":
        assert torch.equal(runs[True][0], runs[False][0])
    else:
        torch.testing.assert_close(runs[True][0], runs[False][0], rtol=5e-3, atol=5e-3)
    on, off = runs[True][1], runs[False][1]
    assert on["layers"]["2"]["lookahead_needed"] > 0 and off["lookahead_needed"] == 0
    assert on["layers"]["2"]["prefetched"] > 0 and off["layers"]["2"]["prefetched"] == 0
    assert on["lookahead_hit_rate"] is not None and off["lookahead_hit_rate"] is None


def test_a_hybrid_prefetch_share_moves_predicted_misses_from_the_cpu_to_the_link(
        synth_moe, monkeypatch):
    """FREETOKEN_HYBRID_PREFETCH=1: a hybrid layer fetches every predicted miss of the next
    layer while it computes; 0: the split's share (half). The next layer then finds them as
    hits, so the link carries more and the CPU computes fewer experts; the logits stay those
    of the split's share, and of no look-ahead at all (the CPU's kernels read float32
    activations here, so only the order of sums differs)."""
    runs = {}
    for share in ("0", "1", "off"):
        monkeypatch.setenv("FREETOKEN_HYBRID_PREFETCH", "0" if share == "off" else share)
        model = load_ours(synth_moe, strategy="hybrid", cache=CacheSizing("size", 40),
                          lookahead="off" if share == "off" else "auto", online=False,
                          act="f32")
        for m in model.modules():
            if isinstance(m, HybridExperts):
                m.policy.fraction, m.policy.max_fetch = 0.5, None
        runs[share] = our_logits(model, list(range(300, 340)), prefill=1), offload_stats(model)
    (split, st_split), (every, st_every), (none, st_none) = runs["0"], runs["1"], runs["off"]
    torch.testing.assert_close(every, split, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(none, split, rtol=1e-4, atol=1e-4)
    assert st_none["prefetched"] == 0 < st_split["prefetched"] < st_every["prefetched"]
    assert st_every["cpu_experts"] < st_split["cpu_experts"] < st_none["cpu_experts"]
    monkeypatch.setenv("FREETOKEN_HYBRID_PREFETCH", "2")
    from freetoken import env
    from freetoken.errors import ConfigError

    with pytest.raises(ConfigError, match="FREETOKEN_HYBRID_PREFETCH='2'"):
        env.hybrid_prefetch()
    monkeypatch.delenv("FREETOKEN_HYBRID_PREFETCH")
    assert env.hybrid_prefetch() == env.HYBRID_PREFETCH


def test_a_hybrid_layers_prefetch_share(tiny_qwen3_moe, monkeypatch):
    """Of 8 predicted misses: 40 % (3), or the split's share where that is more, capped by
    --moe-hybrid-max-fetch; none before the split has a share; FREETOKEN_HYBRID_PREFETCH=0:
    the split's share alone."""
    model = load_ours(tiny_qwen3_moe, strategy="hybrid", cache=CacheSizing("size", 4))
    m = next(m for m in model.modules() if isinstance(m, HybridExperts))
    for fraction, cap, want in ((0.25, None, 3), (0.9, None, 7), (0.25, 1, 1), (None, None, 0),
                                (1.0, None, 8)):
        m.policy = SplitPolicy(fraction, cap, online=False)
        assert m.prefetch_rule().count(8) == want, (fraction, cap)
    monkeypatch.setenv("FREETOKEN_HYBRID_PREFETCH", "0")
    m = next(m for m in load_ours(tiny_qwen3_moe, strategy="hybrid",
                                  cache=CacheSizing("size", 4)).modules()
             if isinstance(m, HybridExperts))
    m.policy = SplitPolicy(0.25, None, online=False)
    assert m.prefetch_rule().count(8) == 2


def test_prediction_beats_chance_on_a_synthetic_checkpoint(synth_moe):
    """Top-2 of 32 experts: a random guess holds 1/16 of what a layer routes to; the next
    layer's router on this layer's input holds most of it, and its fetches turn misses into
    hits with the same logits as without it."""
    logits, stats = {}, {}
    for on in (True, False):
        model = load_ours(synth_moe, strategy="offload", cache=CacheSizing("size", 40),
                          lookahead="auto" if on else "off")
        logits[on] = our_logits(model, list(range(300, 340)), prefill=1)
        stats[on] = offload_stats(model)
    assert torch.equal(logits[True], logits[False])
    layers = stats[True]["layers"]
    rates = [v["lookahead_hit_rate"] for k, v in layers.items() if k != "0"]
    assert len(rates) == 5 and min(rates) > 0.5, rates
    assert layers["0"]["lookahead_hit_rate"] is None  # no layer before it
    assert stats[True]["misses"] < stats[False]["misses"]


def test_picks_made_in_the_graph_piece_fetch_what_the_eager_plan_fetches(tiny_qwen3_moe,
                                                                          tmp_path,
                                                                          gather_on_cpu):
    """Between decode graph pieces the next layer's router runs in the piece before and its
    picks reach the plan with the routed ids (``HostCopies.predicted``; the plan reads no
    hidden state): the same experts are prefetched into the same slots as when the eager
    plan runs the router itself, call after call."""
    from freetoken.moe.host_steps import HostCopies

    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q8.gguf",
                           lambda n, s: "q8_0" if ".experts." in n else "f32")
    eager, piece = (load_ours(path, strategy="offload", cache=CacheSizing("size", 6))
                    for _ in range(2))
    first = [next(m for m in model.modules() if isinstance(m, OffloadExperts))
             for model in (eager, piece)]
    la = first[1].lookahead
    assert la is not None and la.target.shape.layer == 2
    shape = first[0].shape
    g = torch.Generator().manual_seed(3)
    prefetched = 0
    for _ in range(12):
        x = torch.randn(1, shape.hidden, generator=g)
        ids = torch.randperm(shape.num_experts, generator=g)[:shape.top_k].view(1, -1)
        w = torch.rand(1, shape.top_k, generator=g)
        first[0]._plan(x, ids, w)
        nan = torch.full_like(x, float("nan"))
        host = HostCopies(x[:0], ids.clone(), w[:0], x[:0].float(), la.route(x))
        first[1]._plan(nan, ids, torch.full_like(w, float("nan")), host)
        pools = [m.runtime.cache.pool(2) for m in first]
        assert pools[0].state() == pools[1].state()
        came = [m.lookahead.target.incoming for m in first]
        assert came[0].predicted == came[1].predicted
        assert came[0].prefetched == came[1].prefetched
        prefetched += len(came[1].prefetched)
        for m in first:  # the next layer's call takes what arrived
            m.lookahead.target.incoming.clear()
    assert prefetched > 0


@pytest.fixture(scope="module")
def synth_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ft synth``'s gemma4-26b-a4b in the Gemma-4 architecture at a tiny geometry: 6
    layers of 32 q8_0 experts (top-2), default router."""
    from dataclasses import replace

    from freetoken.checkpoint.synth.presets import PRESETS, SynthSpec, parse_expert_formats
    from freetoken.checkpoint.synth.write import write_synth

    p = replace(PRESETS["gemma4-26b-a4b"], hidden=64, moe_intermediate=32, experts=32, top_k=2,
                layers=6, heads=4, kv_heads=2, head_dim=16, full_head_dim=32, full_kv_heads=1,
                intermediate=96, vocab=512, sliding_window=6)
    spec = SynthSpec(p, parse_expert_formats("q8_0", p.layers))
    return write_synth(spec, tmp_path_factory.mktemp("gemma4") / "gemma4.gguf")


def test_gemma4s_router_map_is_the_next_router_on_this_layers_residual(synth_gemma4):
    """Gemma-4's router normalises and scales its own input: on layer L's experts' input the
    map gives the logits layer L+1's router gives on layer L's residual stream; a norm
    weight of 0 leaves its column out instead of dividing by it."""
    from freetoken.models.gemma4 import Gemma4DecoderLayer, _rms

    model = load_ours(synth_gemma4)
    layers = [m for m in model.modules() if isinstance(m, Gemma4DecoderLayer) and m.moe]
    this, nxt = layers[2], layers[3]
    h = torch.randn(5, this.router.proj.weight.shape[1], generator=torch.Generator().manual_seed(1))
    weight, bias = nxt.router_map(this)
    r = nxt.router
    want = r.proj(_rms(h, r.eps) * r.scale * r.root)
    got = torch.nn.functional.linear(this.pre_feedforward_layernorm_2(h), weight)
    assert bias is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    this.pre_feedforward_layernorm_2.weight.data[7] = 0.0
    weight, _ = nxt.router_map(this)
    assert weight.isfinite().all() and not weight[:, 7].any()


def test_gemma4_predicts_with_look_ahead_and_changes_no_output(synth_gemma4):
    """Every Gemma-4 layer but the last predicts for the next; offload's logits are the same
    with and without it, and the prediction holds most of what the next layer routes to
    (chance: 1/16)."""
    logits, stats = {}, {}
    for on in (True, False):
        model = load_ours(synth_gemma4, strategy="offload", cache=CacheSizing("size", 40),
                          lookahead="auto" if on else "off")
        linked = [m for m in model.modules()
                  if isinstance(m, OffloadExperts) and m.lookahead is not None]
        assert len(linked) == (5 if on else 0)
        logits[on] = our_logits(model, list(range(300, 340)), prefill=1)
        stats[on] = offload_stats(model)
    assert torch.equal(logits[True], logits[False])
    rates = [v["lookahead_hit_rate"] for k, v in stats[True]["layers"].items() if k != "0"]
    assert len(rates) == 5 and min(rates) > 0.5, rates
    assert stats[True]["misses"] < stats[False]["misses"]
