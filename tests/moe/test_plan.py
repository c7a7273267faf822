"""The MoE plan: each strategy's declared needs, every ``auto`` resolved into one frozen plan
before the model is built, and the runner's one CPU pool handed to everything that uses it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing, EngineConfig
from freetoken.cpu import executor as cx
from freetoken.cpu.cores import core_plan, plan_cores, usable_cores
from freetoken.moe.decode_check import DecodeCheck
from freetoken.moe.layer_kind import LayerKind, layer_kinds
from freetoken.moe.plan import (
    MoEPlan,
    auto_recommendation,
    plan_auto,
    plan_moe,
    resident_budget,
)
from freetoken.moe.profile import Profile, Row
from freetoken.moe.registry import STRATEGIES, needs_of
from freetoken.moe.strategy import LayerPlan, Needs

needs_pool = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


@pytest.fixture(scope="module")
def q8_gguf(tiny_qwen3_moe, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "q8.gguf"
    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), out,
                           lambda n, s: "q8_0" if ".experts." in n or "proj" in n else "f32")


def _cfg(path, strategy: str, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", moe_strategy=strategy,
                        max_seq_len=64, **kw)


def test_each_strategy_declares_its_needs():
    assert needs_of("resident") == Needs()
    assert needs_of("offload") == Needs(host_banks=True, device_cache=True)
    assert needs_of("hybrid") == Needs(cpu_pool=True, host_banks=True, device_cache=True)
    assert needs_of("cpu") == Needs(cpu_pool=True, host_banks=True)
    union = Needs()
    for cls in STRATEGIES.values():
        union = union | cls.NEEDS
    assert needs_of("auto") == union == Needs(True, True, True)


@pytest.mark.parametrize("strategy, cache, pool", [
    ("resident", None, False), ("offload", "from_auto", False), ("cpu", None, True),
    ("hybrid", "given", True),
])
def test_the_plan_resolves_every_auto(q8_gguf, strategy, cache, pool, monkeypatch, tmp_path):
    if pool and cx.available() is not None:
        pytest.skip(str(cx.available()))
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    sizing = CacheSizing("size", 3) if cache == "given" else CacheSizing()
    plan = plan_moe(_cfg(q8_gguf, strategy, moe_cache=sizing), open_checkpoint(q8_gguf),
                    torch.device("cpu"))
    assert plan.strategies == (strategy, "resident", strategy)  # layer 1 is a dense MLP
    assert plan.needs == needs_of(strategy)
    if cache is None:
        assert plan.cache is None
    elif cache == "from_auto":  # --moe-cache-auto is a byte budget now, still named as given
        assert plan.cache.kind == "mem" and plan.cache.from_auto and plan.cache.value > 0
        assert plan.cache.describe() == "--moe-cache-auto"
    else:
        assert plan.cache == sizing
    assert plan.pool_threads == (len(plan_cores(usable_cores(), None)) if pool else 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pool_threads = 3  # type: ignore[misc]


@needs_pool
@pytest.mark.parametrize("max_fetch, cap", [("auto", 1), (3, 3)])
def test_hybrid_split_without_a_profile_row(q8_gguf, monkeypatch, tmp_path, caplog, max_fetch,
                                            cap):
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    cfg = _cfg(q8_gguf, "hybrid", moe_cpu_threads=2, moe_hybrid_max_fetch=max_fetch,
               moe_hybrid_online=False, moe_cache=CacheSizing("size", 3))
    with caplog.at_level("INFO"):
        plan = plan_moe(cfg, open_checkpoint(q8_gguf), torch.device("cpu"))
    assert plan.layers[0] == plan.layers[2] == LayerPlan("hybrid", None, cap, False, "")
    want = len(core_plan(usable_cores(), True, 2).workers)  # 2, or what the cores allow
    assert plan.pool_threads == want
    assert f"MoE plan: hybrid on 2 q8_0 layers at a fetch cap of {cap}" in caplog.text
    assert "MoE plan: hybrid on layers 0, 2; expert cache --moe-cache-size 3; CPU pool " \
           f"{want} workers" in caplog.text
    assert ("--moe-cpu-threads 2 would leave the engine thread no core" in caplog.text) == \
        (want < 2)


@needs_pool
def test_the_runner_makes_one_pool_and_hands_it_down(q8_gguf):
    from freetoken.engine.runner import ModelRunner
    from freetoken.layers.pool_linear import PoolLinear
    from freetoken.moe.cpu import CpuExperts

    cfg = _cfg(q8_gguf, "cpu", moe_cpu_threads=1, cpu_dense="pool")
    runner = ModelRunner(cfg, kv_tokens=64, progress=False)
    assert isinstance(runner.moe, MoEPlan) and runner.moe.pool_threads == 1
    assert runner.pool is not None and runner.pool.threads == 1
    experts = [m for m in runner.model.modules() if isinstance(m, CpuExperts)]
    linears = [m for m in runner.model.modules() if isinstance(m, PoolLinear)]
    assert len(experts) == 2 and linears
    assert all(m._pool is runner.pool for m in experts)
    assert all(m.pool is runner.pool for m in linears)
    natives = [layer.native for layer in runner.model.model.layers if layer.native is not None]
    assert natives and all(n._ex is runner.pool for n in natives)
    other = ModelRunner(cfg, kv_tokens=64, progress=False, pool=runner.pool)
    assert other.pool is runner.pool  # a second runner in the process shares it


def test_auto_keeps_to_the_expert_memory_it_is_given():
    """48 MoE layers of 1.2 GB resident: with a 4 GB cap (none fit alongside a useful cache)
    every layer is offloaded and the cap is the cache; a cap that holds them all makes all
    resident; with no cap, layers go resident while the free memory lasts."""
    layer, n, free = 1_200_000_000, 48, 130_000_000_000
    kinds = {LayerKind("gguf", 2048, 768, 8, (("down_type", "8"), ("gate_up_type", "8"))):
             list(range(n))}
    recommend = {k: None for k in kinds}.get
    capped = plan_auto(kinds, n, layer, resident_budget(free, 4_000_000_000, n * layer),
                       recommend)
    assert capped == ("offload",) * n
    assert plan_auto(kinds, n, layer, resident_budget(free, 60_000_000_000, n * layer),
                     recommend) == ("resident",) * n
    assert resident_budget(10 * layer, 60_000_000_000, n * layer) == 0  # the cap, not free
    uncapped = plan_auto(kinds, n, layer, resident_budget(10 * layer, None, n * layer),
                         recommend)
    assert uncapped == ("resident",) * 10 + ("offload",) * (n - 10)


def test_resident_layers_kept_as_blocks_count_their_file_bytes(q8_gguf, tmp_path, monkeypatch):
    """What ``auto`` budgets for one resident layer: on a GPU that keeps the blocks, the file's
    bytes of its experts (here q8_0: 34 bytes per 32 weights); dequantised (or in a format
    without a kernel), the compute dtype's."""
    from freetoken.moe import plan
    from freetoken.moe.host_banks import expert_bytes

    ckpt = open_checkpoint(q8_gguf)
    mc = ckpt.config
    cfg = dataclasses.replace(_cfg(q8_gguf, "auto"), dtype="bfloat16")
    at_dtype = 3 * mc.num_experts * mc.hidden_size * mc.moe_intermediate_size * 2
    monkeypatch.setattr(plan, "keeps_blocks", lambda device: True)
    _, blocks = plan._device_bytes(cfg, ckpt)
    assert blocks == expert_bytes(ckpt) // sum(mc.moe_layers)
    assert blocks == at_dtype // 2 * 34 // 32  # q8_0 is 17/32 of bf16's bytes
    monkeypatch.setattr(plan, "keeps_blocks", lambda device: False)
    assert plan._device_bytes(cfg, ckpt)[1] == at_dtype
    monkeypatch.setattr(plan, "keeps_blocks", lambda device: True)
    bf16 = convert_to_gguf(ckpt, tmp_path / "bf16.gguf",
                           lambda n, s: "bf16" if ".experts." in n else "f32")
    cfg32 = dataclasses.replace(cfg, dtype="float32")  # bf16 blocks have no kernel: float32
    assert plan._device_bytes(cfg32, open_checkpoint(bf16))[1] == 2 * at_dtype


def test_auto_trusts_a_hybrid_row_only_where_it_was_measured(caplog):
    """A row that recommends hybrid sends auto's layers to hybrid only when it was measured at
    this run's thread count, ISA and CPU model; measured elsewhere (the 15-thread AVX-512 row
    on a 3-thread AVX2 run) the layers offload, with a line saying why. Rows that recommend
    offload are followed wherever they come from."""
    kind = LayerKind("gguf", 2048, 768, 8, (("down_type", "8"), ("gate_up_type", "8")))
    cpu = "Some Xeon"
    hybrid = Row(100.0, 31.5, 90.0, 30.0, {"isa": "avx512_bf16", "cpu_model": cpu})
    assert hybrid.recommended == "hybrid"
    offload = Row(40.0, 50.0, 3.0, 49.0, {"isa": "avx2", "cpu_model": "other"})
    profile = Profile(Path("p.json"), {kind.key(15): hybrid})
    caplog.set_level(logging.INFO, logger="freetoken.moe.plan")
    assert auto_recommendation(profile, kind, 15, "avx512_bf16", cpu) == "hybrid"
    assert not [r for r in caplog.records if "cannot say" in r.message]
    for threads, isa, model, why in ((3, "avx512_bf16", cpu, "another thread count"),
                                     (15, "avx2", cpu, "at avx512_bf16, not avx2"),
                                     (15, "avx512_bf16", "An EPYC", "not this An EPYC")):
        caplog.clear()
        assert auto_recommendation(profile, kind, threads, isa, model) == "offload"
        assert why in caplog.text and "ft bench bw" in caplog.text
    other = Profile(Path("p.json"), {kind.key(15): offload})
    assert auto_recommendation(other, kind, 3, "avx512_bf16", cpu) == "offload"
    assert auto_recommendation(Profile(Path("p.json"), {}), kind, 3, "avx2", cpu) is None


def test_auto_offloads_where_the_decode_check_measured_offload_faster(caplog):
    """A row that recommends hybrid, measured here, whose decode check at this run's expert
    cache decoded offload faster (the nvfp4 Gemma-4 file on an H100: 65.9 against 60.1) sends
    auto's layers to offload, saying so; a check where hybrid won keeps hybrid, and one made
    at another cache leaves the choice to the GB/s, with a line that says so."""
    kind = LayerKind("gguf", 2816, 704, 8, (("down_type", "8"), ("gate_up_type", "8")))
    cpu, isa, gb4 = "Some Xeon", "avx512_bf16", 4_000_000_000
    meta = {"isa": isa, "cpu_model": cpu}

    def auto(check: DecodeCheck, cache: CacheSizing) -> str | None:
        profile = Profile(Path("p.json"), {kind.key(15): Row(100.0, 31.5, 90.0, 30.0, meta,
                                                             check)})
        return auto_recommendation(profile, kind, 15, isa, cpu, cache)

    caplog.set_level(logging.INFO, logger="freetoken.moe.plan")
    lost = DecodeCheck("g4.gguf", gb4, 128, {"offload": 65.9, "hybrid": 60.1})
    assert auto(lost, CacheSizing("mem", 4e9)) == "offload"
    assert "measured offload 65.9, hybrid 60.1 tok/s; those layers offload" in caplog.text
    won = DecodeCheck("q3.gguf", gb4, 128, {"offload": 25.7, "hybrid": 38.5, "cpu": 36.0})
    assert auto(won, CacheSizing("mem", 4e9)) == "hybrid"
    caplog.clear()  # cpu on flags measured faster than hybrid: those layers run cpu
    cpu_won = DecodeCheck("q3.gguf", gb4, 128, {"offload": 25.7, "hybrid": 43.3, "cpu": 51.7})
    assert auto(cpu_won, CacheSizing("mem", 4e9)) == "cpu"
    assert "measured offload 25.7, cpu 51.7, hybrid 43.3 tok/s; those layers run cpu" \
        in caplog.text
    assert cpu_won.fastest() == "cpu" and lost.fastest() == "offload"
    assert DecodeCheck("m", gb4, 8, {"offload": 30.0, "hybrid": 30.0}).fastest() == "offload"
    caplog.clear()
    assert auto(lost, CacheSizing("mem", 8e9)) == "hybrid"
    assert "made with a 4GB expert cache, not this run's (--moe-cache-mem 8GB)" in caplog.text
    assert auto(lost, CacheSizing("rate", 0.5)) == "hybrid"
    caplog.clear()
    unchecked = Profile(Path("p.json"), {kind.key(15): Row(100.0, 31.5, 90.0, 30.0, meta)})
    assert auto_recommendation(unchecked, kind, 15, isa, cpu, CacheSizing("mem", 4e9)) == \
        "hybrid"
    assert "from the profile's GB/s alone" in caplog.text and "--decode-check" in caplog.text
    with pytest.raises(ValueError, match="offload's figure"):
        DecodeCheck("m", gb4, 128, {"hybrid": 60.1})


@needs_pool
@pytest.mark.parametrize("hybrid_tps, online", [(38.5, True), (38.5, False), (60.1, True)])
def test_hybrid_asked_for_starts_at_all_fetch_where_its_check_lost(
        q8_gguf, monkeypatch, tmp_path, caplog, hybrid_tps, online):
    """--moe-strategy hybrid runs what was asked for; where the row's decode check at this
    cache measured it slower than offload, that is a warning naming both figures, and an
    online split starts holding all-fetch (offload's pace) with the profile's and the cpu arm
    sitting the first wall check out. A check hybrid won changes nothing."""
    from freetoken.moe.hybrid import HybridExperts
    from freetoken.moe.profile import save_rows
    from tests.models.helpers import load_ours

    path = tmp_path / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(path))
    threads = len(core_plan(usable_cores(), True, 1).workers)
    (kind,) = layer_kinds(open_checkpoint(q8_gguf))
    check = DecodeCheck(str(q8_gguf), 100_000, 128, {"offload": 50.0, "hybrid": hybrid_tps})
    save_rows({kind.key(threads): Row(100.0, 31.5, 90.0, 30.0, {}, check)}, path)
    lost = hybrid_tps < 50.0
    cfg = _cfg(q8_gguf, "hybrid", moe_cpu_threads=1, moe_hybrid_online=online,
               moe_cache=CacheSizing("mem", 100_000))
    with caplog.at_level("INFO"):
        plan = plan_moe(cfg, open_checkpoint(q8_gguf), torch.device("cpu"))
    assert plan.layers[0].start_fetch == plan.layers[2].start_fetch == lost
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"measured offload 50.0, hybrid {hybrid_tps} tok/s, so offload decodes faster"
               in m for m in said) == lost
    if not (lost and online):
        return
    assert any("the split starts at all-fetch" in m for m in said)
    model = load_ours(q8_gguf, strategy="hybrid", cache=CacheSizing("mem", 100_000))
    (costs,) = {id(m.policy.costs): m.policy.costs for m in model.modules()
                if isinstance(m, HybridExperts)}.values()
    assert costs.check.choice == "fetch" and costs.check.benched
    assert costs.check.arms == ("fetch", "split", "cpu", "profile")
    assert [a for a in costs.check.arms if costs.check._sits(a)] == ["cpu", "profile"]


def test_auto_runs_the_cpu_where_it_alone_is_fastest():
    """A row whose CPU alone beats PCIe by far and the two overlapped add little (the link's
    reads share the CPU's memory bandwidth) sends auto's layers to cpu, measured here; a
    row measured on another box sends them to offload, as for hybrid."""
    kind = LayerKind("gguf", 2048, 768, 8, (("down_type", "8"), ("gate_up_type", "8")))
    row = Row(123.0, 53.0, 86.0, 48.0, {"isa": "avx512_bf16", "cpu_model": "Some Xeon"})
    assert row.recommended == "cpu"
    profile = Profile(Path("p.json"), {kind.key(15): row})
    assert auto_recommendation(profile, kind, 15, "avx512_bf16", "Some Xeon") == "cpu"
    assert auto_recommendation(profile, kind, 15, "avx2", "Some Xeon") == "offload"
    plan = plan_auto({kind: [0, 1, 2]}, 3, 100, 100,
                     lambda k: auto_recommendation(profile, k, 15, "avx512_bf16", "Some Xeon"))
    assert plan == ("resident", "cpu", "cpu")
