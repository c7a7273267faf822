"""The cpu strategy's warm reads (``moe/cpu_warm.py``): the next layer's router picks the
experts to read ahead, a model's cpu layers are linked to their next layer, and host steps with
warm reads give the bits they give without (the next step's job cancels the read)."""

from __future__ import annotations

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.moe import cpu_warm
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.lookahead import Lookahead
from freetoken.moe.pieces import HostCopies
from freetoken.moe.strategy import ExpertShape
from tests.moe.helpers import q8_cpu_layer

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

E, H, I_ = 16, 64, 96


def _layer(layer: int, pool: cx.CpuMoeExecutor) -> CpuExperts:
    return q8_cpu_layer(ExpertShape(layer=layer, num_experts=E, hidden=H, intermediate=I_,
                                    top_k=4, activation="silu"), pool, seed=layer)


def test_the_prediction_is_the_next_routers_picks_first_choices_first() -> None:
    weight = torch.zeros(E, H)
    x = torch.zeros(3, H)
    # token t's logits: expert e scores score[t][e] through one hidden unit each
    score = {0: {5: 4.0, 2: 3.0, 9: 2.0, 1: 1.0}, 1: {2: 4.0, 7: 3.0, 5: 2.0, 3: 1.0},
             2: {11: 4.0, 5: 3.0, 12: 2.0, 13: 1.0}}
    for t, picks in score.items():
        x[t, t] = 1.0
        for e, s in picks.items():
            weight[e, t] = s
    nxt = Lookahead(0, weight, None, top_k=4, target=None)
    got = cpu_warm.predict(nxt, x, most=64).tolist()
    firsts, seconds = [5, 2, 11], [2, 7, 5]
    assert got[:3] == firsts
    assert got[3:4] == [7]  # the second choices not yet listed
    assert got == list(dict.fromkeys(firsts + seconds + [9, 5, 12] + [1, 3, 13]))
    assert cpu_warm.predict(nxt, x, most=2).tolist() == [5, 2]
    # a prompt's chunk: no prediction
    assert cpu_warm.predict(nxt, torch.zeros(17, H), most=64) is None
    torch.testing.assert_close(  # with a bias, as GPT-OSS's router has
        cpu_warm.predict(Lookahead(0, weight, torch.arange(E, dtype=torch.float32) * 10, 2, None),
                         x[:1], 64), torch.tensor([15, 14], dtype=torch.int32))


def test_a_models_cpu_layers_are_linked_to_the_next_layers_router(tiny_qwen3_moe,
                                                                  monkeypatch) -> None:
    from freetoken.errors import ConfigError
    from tests.models.helpers import load_ours

    monkeypatch.setenv("FREETOKEN_CPU_WARM", "on")
    model = load_ours(tiny_qwen3_moe, strategy="cpu")
    layers = sorted((m for m in model.modules() if isinstance(m, CpuExperts)),
                    key=lambda m: m.shape.layer)
    assert all(m.warm_next is None for m in layers)  # never on the CPU: no GPU time to fill
    monkeypatch.setenv("FREETOKEN_CPU_WARM", "yes")
    with pytest.raises(ConfigError, match="FREETOKEN_CPU_WARM='yes' is not one of off, on"):
        load_ours(tiny_qwen3_moe, strategy="cpu")
    assert cpu_warm.link(model, lambda m: isinstance(m, CpuExperts)) == len(layers) - 1
    blocks = {m.experts.shape.layer: m for m in model.modules() if hasattr(m, "gate")
              and isinstance(getattr(m, "experts", None), CpuExperts)}
    for this, nxt in zip(layers, layers[1:], strict=False):
        link = this.warm_next
        assert link is not None and link.target is nxt
        assert torch.equal(link.weight, blocks[nxt.shape.layer].gate.weight.float().cpu())
    assert layers[-1].warm_next is None


def test_host_steps_with_warm_reads_give_the_same_bits_and_score_the_prediction() -> None:
    """Two layers' host steps, step after step: layer 0's step reads layer 1's predicted
    experts ahead; both layers' outputs are those of the steps without it, and layer 1 counts
    how many of the experts read ahead it routed to (all, where its input is layer 0's)."""
    pool = cx.CpuMoeExecutor(threads=1)
    first, second = _layer(0, pool), _layer(1, pool)
    g = torch.Generator().manual_seed(7)
    router = torch.randn(E, H, generator=g)
    T = 2

    def host() -> HostCopies:
        return HostCopies(torch.empty(T, H), torch.empty(T, 4, dtype=torch.int64),
                          torch.empty(T, 4), torch.empty(T, H))

    hosts = [host(), host()]

    def steps(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=gen)  # the residual stream, unchanged between layers
        outs = []
        for layer, h in zip((first, second), hosts, strict=True):
            ids = torch.topk(x @ router.t(), 4).indices if layer is second else torch.stack(
                [torch.randperm(E, generator=gen)[:4] for _ in range(T)])
            h.x.copy_(x), h.ids.copy_(ids), h.w.copy_(torch.full((T, 4), 0.25))
            outs.append(layer._host_step(h.x, h.ids, h.w, h).clone())
        return outs

    plain = [steps(s) for s in range(5)]
    assert second.host_times.warmed == 0
    first.warm_next = Lookahead(1, router, None, top_k=4, target=second)
    reads = pool.warm_stats()[0]
    warmed = [steps(s) for s in range(5)]
    for a, b in zip(plain, warmed, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
    assert pool.warm_stats()[0] == reads + 5  # one read a step, from layer 0's step
    times = second.host_times  # the same x: the prediction is right, every expert used
    want = sum(len(set(torch.topk(torch.randn(T, H, generator=torch.Generator().manual_seed(
        s)) @ router.t(), 4).indices.view(-1).tolist())) for s in range(5))
    assert times.warmed == times.warm_used == want
    assert first.host_times.warmed == 0  # nothing reads ahead for the first layer


@pytest.mark.cuda
def test_graphs_with_warm_reads_decode_the_same_tokens(tiny_qwen3_moe, monkeypatch) -> None:
    """cpu on a GPU, decode graphs broken at each layer's experts: with warm reads on, the
    tokens of the run without them, alone and batched, and the next layers score the reads."""
    from freetoken.engine.sample import SamplingParams
    from freetoken.engine.scheduler import Scheduler, Sequence
    from tests.engine.test_scheduler import _drain, _prompts, _runner

    def tokens(warm: str) -> tuple[dict[str, list[int]], int, int]:
        monkeypatch.setenv("FREETOKEN_CPU_WARM", warm)
        runner = _runner(tiny_qwen3_moe, device="cuda", graphs=8, strategy="cpu")
        s = Scheduler(runner, max_running=4, prefix_cache=False)
        for i, prompt in enumerate(_prompts(4)):
            s.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
        out = {rid: [e.token for e in ev] for rid, ev in _drain(s).items()}
        layers = [m for m in runner.model.modules() if isinstance(m, CpuExperts)]
        warmed = sum(m.host_times.warmed for m in layers)
        used = sum(m.host_times.warm_used for m in layers)
        return out, warmed, used

    plain, warmed, _ = tokens("off")
    assert warmed == 0
    got, warmed, used = tokens("on")
    assert got == plain
    assert warmed > 0 and 0 < used <= warmed
