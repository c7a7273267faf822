"""Continuous batching must not change results: batched = solo, prefix-cached = recomputed."""

from __future__ import annotations

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.runner import ModelRunner
from freetoken.engine.sample import SamplingParams
from freetoken.engine.scheduler import Scheduler, Sequence


def _runner(path, kv_tokens=2048, page=16, device="cpu", graphs=0, strategy="resident"):
    cfg = EngineConfig(model=str(path), device=device, dtype="float32", moe_strategy=strategy,
                       max_seq_len=256, cuda_graph_max_bs=graphs)
    return ModelRunner(cfg, kv_tokens=kv_tokens, page_size=page, progress=False)


def _drain(sched: Scheduler) -> dict[str, list]:
    events: dict[str, list] = {}
    while sched.has_work():
        for e in sched.step():
            events.setdefault(e.rid, []).append(e)
    return events


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 250 + 1 for j in range(5 + 9 * i)] for i in range(n)]


@pytest.mark.parametrize("device, graphs", [
    ("cpu", 0), pytest.param("cuda", 0, marks=pytest.mark.cuda),
    pytest.param("cuda", 8, marks=pytest.mark.cuda, id="cuda-graphs")])
@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "tiny_gemma3", "tiny_gpt_oss"])
def test_batched_equals_solo(fixture, request, device, graphs):
    runner = _runner(request.getfixturevalue(fixture), device=device, graphs=graphs)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    solo = {}
    for i, prompt in enumerate(_prompts(8)):
        s = Scheduler(runner, max_running=1, prefix_cache=False)
        s.add(Sequence(f"r{i}", prompt, params))
        solo[f"r{i}"] = [e.token for e in _drain(s)[f"r{i}"]]
    # all eight at once, prefill chunked at 16 tokens per step so prefills and decodes mix
    s = Scheduler(runner, max_running=8, max_prefill_tokens=16, prefix_cache=False)
    for i, prompt in enumerate(_prompts(8)):
        s.add(Sequence(f"r{i}", prompt, params))
    batched = {rid: [e.token for e in ev] for rid, ev in _drain(s).items()}
    assert batched == solo
    times = s.stats()["times"]  # every sampled token counted once, in steps that took time
    assert times["tokens"] == 8 * 12 and times["steps"] >= 12
    assert min(times[k] for k in ("schedule_s", "forward_s", "sample_s")) > 0
    scratch = 1 if runner.graphs else 0
    assert runner.kv.free_pages == runner.kv.num_pages - scratch  # every page came back


def test_prefix_cache_reuses_pages_and_keeps_results(tiny_qwen3_moe):
    runner = _runner(tiny_qwen3_moe)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    system = [(5 * j) % 250 + 1 for j in range(70)]
    s = Scheduler(runner, max_running=4)
    s.add(Sequence("a", system + [3, 4, 5], params))
    first = _drain(s)["a"]
    s.add(Sequence("b", system + [9, 9], params))
    second = _drain(s)["b"]
    assert first[-1].cached_tokens == 0
    assert second[-1].cached_tokens == 64  # 4 full pages of 16 of the shared 70 tokens
    fresh = Scheduler(runner, max_running=4, prefix_cache=False)
    fresh.add(Sequence("b", system + [9, 9], params))
    assert [e.token for e in second] == [e.token for e in _drain(fresh)["b"]]


def test_admission_waits_for_kv_and_rejects_what_never_fits(tiny_qwen3_moe):
    runner = _runner(tiny_qwen3_moe, kv_tokens=64, page=16)  # 4 pages
    s = Scheduler(runner, max_running=8, prefix_cache=False)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(3):  # each needs 2 pages: two run, one waits
        assert s.add(Sequence(f"r{i}", list(range(1, 11)), params)) is None
    first = s.step()
    assert len(s.running) == 2 and len(s.waiting) == 1
    events = _drain(s)
    for e in first:
        events[e.rid].insert(0, e)
    assert all(ev[-1].finish_reason == "length" and len(ev) == 20 for ev in events.values())
    too_big = s.add(Sequence("big", list(range(1, 60)), params))
    assert too_big is not None and too_big.finish_reason == "error"
    assert "exceeds the context" in (too_big.error or "")


def test_abort_frees_pages(tiny_qwen3_moe):
    runner = _runner(tiny_qwen3_moe)
    s = Scheduler(runner, prefix_cache=False)
    s.add(Sequence("x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)))
    s.step()
    assert s.abort("x").finish_reason == "abort"
    assert not s.has_work() and runner.kv.free_pages == runner.kv.num_pages


@pytest.mark.cuda
@pytest.mark.parametrize("fixture, strategy", [
    ("tiny_qwen3_moe", "resident"), ("tiny_gemma3", "resident"), ("tiny_gpt_oss", "resident"),
    ("tiny_gpt_oss", "offload"), ("tiny_gpt_oss", "hybrid"), ("tiny_gpt_oss_mxfp4", "resident"),
    ("tiny_gpt_oss_mxfp4", "offload"), ("tiny_gpt_oss_mxfp4", "hybrid"),
    ("tiny_qwen3_moe", "cpu"), ("tiny_gpt_oss", "cpu"), ("tiny_gpt_oss_mxfp4", "cpu")])
def test_graph_decode_matches_eager(fixture, strategy, request):
    from freetoken.layers.context import Segment

    path = request.getfixturevalue(fixture)
    eager = _runner(path, device="cuda", strategy=strategy)
    graphs = _runner(path, device="cuda", graphs=4, strategy=strategy)
    prompts = _prompts(3)
    for r in (eager, graphs):
        r.pages = [r.kv.allocate(r.pages_for(len(p) + 1)) for p in prompts]
        r.forward(prompts, [Segment(pg, 0, len(p)) for pg, p in zip(r.pages, prompts, strict=True)])
    step = [[7], [8], [9]]
    segs = lambda r: [Segment(pg, len(p), 1) for pg, p in zip(r.pages, prompts, strict=True)]  # noqa: E731
    a, b = eager.forward(step, segs(eager)), graphs.forward(step, segs(graphs))
    assert graphs.graphs is not None and graphs.graphs.fits(segs(graphs))
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_a_decode_token_beside_a_prefill_has_its_solo_bits():
    """On the CPU a step that mixes one sequence's decode token with another's prompt runs
    them as two forwards: the decode token keeps the bits it has alone (the embedded Gemma-3
    on the pool: in one forward it took prefill's path and its logits moved by ~0.3), and the
    prompt the bits of its own prefill."""
    from freetoken.checkpoint import default_model_path
    from freetoken.layers.context import Segment

    cfg = EngineConfig(model=str(default_model_path()), device="cpu", dtype="float32",
                       moe_strategy="resident", max_seq_len=256, cpu_dense="pool",
                       moe_cpu_threads=1)
    runner = ModelRunner(cfg, kv_tokens=512, page_size=16, progress=False)
    a = [2, 651, 4281, 529, 6081, 563, 506, 5279, 529, 9405, 236764]
    b = [2, 9259, 1902, 236764, 1217, 659, 611, 236881, 1599, 795]
    pa, pb = runner.kv.allocate(2), runner.kv.allocate(2)
    tok = int(runner.forward([a], [Segment(pa, 0, len(a))])[0].argmax())
    solo_decode = runner.forward([[tok]], [Segment(pa, len(a), 1)])[0]
    solo_prompt = runner.forward([b], [Segment(pb, 0, len(b))])[0]
    mixed = runner.forward([[tok], b], [Segment(pa, len(a), 1), Segment(pb, 0, len(b))])
    assert torch.equal(mixed[0], solo_decode) and torch.equal(mixed[1], solo_prompt)


def test_stats_carry_the_cpu_strategys_pool_steps(tiny_qwen3_moe) -> None:
    """A model with cpu layers reports their host steps (``cpu_pool``; none run on the CPU,
    where the layers are called eagerly); one without cpu layers has no such entry."""
    s = Scheduler(_runner(tiny_qwen3_moe, strategy="cpu"), max_running=2)
    s.add(Sequence("r", _prompts(1)[0], SamplingParams(max_tokens=3, ignore_eos=True)))
    _drain(s)
    assert s.stats()["cpu_pool"] == {"calls": 0, "step_s": 0.0, "job_s": 0.0}
    assert "cpu_pool" not in Scheduler(_runner(tiny_qwen3_moe), max_running=2).stats()
