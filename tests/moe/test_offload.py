"""Offload: the expert cache's LRU against a plain model of the policy, host banks against the
checkpoint's bytes, cache sizing, and offload's logits against resident's, bit for bit."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.engine.resolve import parse_bytes
from freetoken.errors import ConfigError
from freetoken.moe.host_banks import BankBuilder, check_host_memory
from freetoken.moe.offload import offload_stats
from freetoken.moe.plan import ExpertGroup, plan_moe_cache
from freetoken.moe.slot_pool import SlotPool
from freetoken.quant import FORMATS, QuantTensor, get_format
from tests.models.helpers import load_ours, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180, 2, 33, 101, 8, 19, 240,
       66, 12, 150, 45, 90, 3, 77, 11]


class ModelLRU:
    """The policy in its plainest form: a list of (layer, expert), least recently used first."""

    def __init__(self, slots: int) -> None:
        self.slots, self.order = slots, []

    def step(self, layer: int, experts: list[int]) -> list[tuple[int, int]]:
        """Returns the evicted entries."""
        needed = {(layer, e) for e in experts}
        for e in experts:
            if (layer, e) in self.order:
                self.order.remove((layer, e))
                self.order.append((layer, e))
        evicted = []
        for e in experts:
            if (layer, e) in self.order:
                continue
            if len(self.order) == self.slots:
                victim = next(k for k in self.order if k not in needed)
                self.order.remove(victim)
                evicted.append(victim)
            self.order.append((layer, e))
        return evicted


def _pool_kinds() -> list[type[SlotPool]]:
    """The Python pool, and the library's where it loads."""
    from freetoken.cpu.library import available
    from freetoken.moe.native_slot_pool import NativeSlotPool

    return [SlotPool] + ([NativeSlotPool] if available() is None else [])


@pytest.mark.parametrize("kind", _pool_kinds(), ids=lambda k: k.__name__)
@pytest.mark.parametrize("seed", range(5))
def test_lru_matches_plain_model_over_random_traces(seed, kind):
    rng = random.Random(seed)
    layers, experts, slots = 4, 16, rng.choice([4, 7, 12, 30])
    pool = kind(8, slots, torch.device("cpu"))
    for layer in range(layers):
        pool.add_layer(layer, experts)
    model = ModelLRU(slots)
    hot = [rng.sample(range(experts), 4) for _ in range(layers)]  # skewed, like real routing
    for _ in range(400):
        layer = rng.randrange(layers)
        k = rng.randint(1, min(4, slots))
        pick = {rng.choice(hot[layer]) if rng.random() < 0.6 else rng.randrange(experts)
                for _ in range(k)}
        wanted = sorted(pick)
        before = set(pool.state()[1])
        hits, misses = pool.lookup(layer, wanted)
        got = pool.admit(layer, misses, set(hits.values()))
        order, owner = pool.state()
        after = set(owner)
        evicted = model.step(layer, wanted)
        assert sorted(before - after - {None}) == sorted(evicted)
        assert after - {None} == set(model.order)
        assert {owner[s] for s in list(hits.values()) + got} == {(layer, e) for e in wanted}
        assert [owner[s] for s in order if owner[s]] == model.order


@pytest.mark.parametrize("kind", _pool_kinds(), ids=lambda k: k.__name__)
def test_admit_never_evicts_what_the_step_needs(kind):
    pool = kind(8, 3, torch.device("cpu"))
    pool.add_layer(0, 8)
    pool.admit(0, [0, 1, 2], set())
    hits, misses = pool.lookup(0, [0, 5])
    slots = pool.admit(0, misses, set(hits.values()))
    owner = pool.state()[1]
    assert owner[hits[0]] == (0, 0) and owner[slots[0]] == (0, 5)
    with pytest.raises(RuntimeError, match="none left to evict"):
        pool.admit(0, [6], {0, 1, 2})


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "bf16", "nvfp4", "fp8_block"])
@pytest.mark.parametrize("stacked", [True, False])
def test_bank_rows_hold_each_experts_checkpoint_bytes(fmt, stacked):
    torch.manual_seed(0)
    E, H, I_ = 3, 256, 256
    q = get_format(fmt)
    weights = {p: torch.randn(E, *((H, I_) if p == "down_proj" else (I_, H)))
               for p in ("gate_proj", "up_proj", "down_proj")}
    b = BankBuilder(0, E, H, I_)
    per_expert = {p: [q.quantize(w[e]) for e in range(E)] for p, w in weights.items()}
    for p in weights:
        if stacked:
            qts = per_expert[p]
            scales = {k: torch.stack([t.scales[k] for t in qts]) for k in qts[0].scales}
            b.add(p, QuantTensor(fmt, (E, *qts[0].shape), torch.stack([t.data for t in qts]),
                                 scales))
        else:
            for e in range(E):
                b.add(p, per_expert[p][e], e)
    bank = b.build(pinned=False)
    for p in weights:
        for e in range(E):
            want = q.dequantize(per_expert[p][e])
            got = get_format(fmt).dequantize(bank.layout.quant(bank.rows[e], p))
            assert torch.equal(got, want), (p, e)
        batch = get_format(fmt).dequantize(bank.layout.quant(bank.rows, p))
        assert torch.equal(batch, torch.stack([q.dequantize(t) for t in per_expert[p]]))


def test_missing_expert_is_named():
    b = BankBuilder(2, 2, 32, 32)
    b.add("gate_proj", get_format("bf16").quantize(torch.randn(2, 32, 32)))
    b.add("up_proj", get_format("bf16").quantize(torch.randn(32, 32)), 1)
    assert b.missing() == ["up_proj[0]", "down_proj"]
    with pytest.raises(ConfigError, match=r"layer 2.*up_proj\[0\], down_proj"):
        b.build(pinned=False)


def test_host_memory_shortage_names_both_sizes():
    with pytest.raises(ConfigError, match=r"need 12\.0 GB of host RAM but only 5\.0 GB"):
        check_host_memory(12 * 10**9, 5 * 10**9)


def test_parse_bytes():
    assert parse_bytes("4GB") == 4 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("2.5e9") == 2_500_000_000
    for bad in ("four", "-1GB", "3XB", ""):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)


def test_cache_plans_split_mixed_formats_by_bytes():
    q8 = ExpertGroup(slot_bytes=5_000_000, layers=tuple(range(29)), experts_per_layer=128)
    bf = ExpertGroup(slot_bytes=10_000_000, layers=(29,), experts_per_layer=128)
    plans = plan_moe_cache(CacheSizing("mem", 4e9), [q8, bf])
    share_q8 = 29 * 5 / (29 * 5 + 10)
    assert plans[0].num_slots == int(4e9 * share_q8) // 5_000_000
    assert plans[1].num_slots == int(4e9 * (1 - share_q8)) // 10_000_000
    assert sum(p.num_slots * p.slot_bytes for p in plans) <= 4e9
    by_size = plan_moe_cache(CacheSizing("size", 100), [q8, bf])
    assert sum(p.num_slots for p in by_size) == 100
    assert [p.num_slots for p in plan_moe_cache(CacheSizing("rate", 0.5), [q8, bf])] == [1856,
                                                                                           64]


def test_a_pool_smaller_than_top_k_is_named(caplog):
    q8 = ExpertGroup(5_000_000, (0, 1), 8, top_k=2)
    bf = ExpertGroup(10_000_000, (2, 3), 8, top_k=2)
    with caplog.at_level("WARNING"):
        plans = plan_moe_cache(CacheSizing("size", 3), [q8, bf])
    assert [p.num_slots for p in plans] == [2, 1]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "1 slot for the 10MB experts of layers 2-3, fewer than the 2 " \
        "experts one token routes to" in warned[0]


def test_auto_cache_uses_the_budget_and_caps_at_all_experts(caplog):
    g = ExpertGroup(slot_bytes=1_000_000, layers=(0, 1), experts_per_layer=64)
    with caplog.at_level("INFO"):
        plans = plan_moe_cache(CacheSizing.resolved(50_500_000), [g])
    assert plans[0].num_slots == 50
    assert "resolved moe_cache_size=50 " in caplog.text
    assert plan_moe_cache(CacheSizing.resolved(10**12), [g])[0].num_slots == 128
    with pytest.raises(ConfigError, match="free device memory leaves no room.*kv-reserve"):
        plan_moe_cache(CacheSizing.resolved(999_999), [g])
    with pytest.raises(ConfigError, match="cache-mem 500KB leaves no room for one 1MB expert"):
        plan_moe_cache(CacheSizing("mem", 500_000), [g])


def test_conflicting_cache_flags_are_refused():
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--moe-cache-mem",
                        "4GB", "--moe-cache-rate", "0.1"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--moe-cache-rate: not allowed with argument --moe-cache-mem" in r.stderr
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--moe-cache-mem",
                        "lots"], capture_output=True, text=True)
    assert r.returncode != 0 and "--moe-cache-mem: 'lots' is not a size" in r.stderr


@pytest.fixture(scope="module", params=["hf", "bf16", "q8_0", "mixed"])
def checkpoint(request, tiny_qwen3_moe, tmp_path_factory):
    if request.param == "hf":
        return tiny_qwen3_moe
    out = tmp_path_factory.mktemp("offload") / f"{request.param}.gguf"

    def fmt(name: str, shape: tuple[int, ...]) -> str:
        if ".experts." not in name:
            return "f32"
        if request.param == "mixed":  # layers 0 and 2 are MoE: one q8_0, one bf16
            return "q8_0" if ".layers.0." in name else "bf16"
        return request.param

    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), out, fmt)


@pytest.mark.parametrize("slots", [1, 3, 6])
def test_offload_logits_equal_resident_bitwise(checkpoint, slots):
    """1 slot: every call streams; 3 and 6: the cache evicts all along the sequence."""
    if slots == 1 and "mixed" in str(checkpoint):
        with pytest.raises(ConfigError, match="needs at least 2 slots, one per expert size"):
            load_ours(checkpoint, strategy="offload", cache=CacheSizing("size", slots))
        return
    resident = our_logits(load_ours(checkpoint), IDS, prefill=4)
    model = load_ours(checkpoint, strategy="offload", cache=CacheSizing("size", slots))
    offload = our_logits(model, IDS, prefill=4)
    assert torch.equal(offload, resident)
    stats = offload_stats(model)
    assert stats is not None and stats["tokens"] == len(IDS)
    if slots == 1:
        assert stats["streamed"] > 0 and stats["hits"] + stats["misses"] == 0
    else:
        assert stats["misses"] > slots and stats["hits"] > 0  # evictions happened
        assert stats["bytes_fetched"] > 0 and stats["bytes_per_token"] > 0
        assert set(stats["layers"]) == {"0", "2"}
        # per layer kind: each kind's layers and times add up to the totals
        kinds = stats["kinds"]
        assert sum(k["layers"] for k in kinds.values()) == 2
        if "mixed" in str(checkpoint):
            assert set(kinds) == {"q8_0", "bf16"}
        for key in ("fetch_s", "compute_s", "plan_s"):
            assert sum(k[key] for k in kinds.values()) == pytest.approx(stats[key])


@pytest.mark.parametrize("group", [1, 3, 8])
def test_a_prompt_streamed_in_dequantisation_groups_equals_resident(tiny_qwen3_moe, tmp_path,
                                                                    monkeypatch, group):
    """FREETOKEN_PREFILL_DEQUANT=chunk: a staging chunk's experts dequantised together, or in
    groups of fewer where they would pass DEQUANT_BYTES (one at a time, or a group that does
    not divide the chunk): a prompt that streams every layer's experts gives resident's
    bits."""
    from freetoken.moe import prefill_stream
    from freetoken.moe.offload import OffloadExperts

    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q8.gguf",
                           lambda n, s: "q8_0" if ".experts." in n else "f32")
    resident = our_logits(load_ours(path), IDS, prefill=len(IDS))
    model = load_ours(path, strategy="offload", cache=CacheSizing("size", 1))
    (bank, *_) = [m.bank for m in model.modules() if isinstance(m, OffloadExperts)]
    elements = sum(r * c for r, c in bank.layout.shapes)
    monkeypatch.setenv("FREETOKEN_PREFILL_DEQUANT", "chunk")
    monkeypatch.setattr(prefill_stream, "DEQUANT_BYTES", group * 4 * elements)
    # chunks of 5 of the 8 experts: a whole chunk and a partial one (staging holds 8 rows)
    monkeypatch.setattr(prefill_stream, "STREAM_CHUNK", 5)
    groups = []
    weights = prefill_stream.PrefillStream.weights

    def spy(self, e, of):
        groups.append(self.group)
        return weights(self, e, of)

    monkeypatch.setattr(prefill_stream.PrefillStream, "weights", spy)
    assert torch.equal(our_logits(model, IDS, prefill=len(IDS)), resident)
    assert groups and set(groups) == {min(group, 5)}
    assert bank.num_experts == 8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_chunks_experts_dequantised_together_are_each_ones_bits(fmt, device):
    """The prefill stream dequantises a staging chunk's experts in one go, a projection at a
    time; each expert's slice is the same bits as that expert dequantised alone (what the
    stream did before, and what resident holds), in every format, at float32 and bfloat16."""
    E, H, inter = 3, 512, 256
    torch.manual_seed(0)
    builder = BankBuilder(0, E, H, inter)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        builder.add(proj, get_format(fmt).quantize(torch.randn((E, *builder.want(proj)))))
    bank = builder.build(pinned=False)
    rows = bank.rows.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            together = bank.layout.weight(rows, proj, dtype)
            assert together.shape == (E, *builder.want(proj))
            for e in range(E):
                assert torch.equal(together[e], bank.layout.weight(rows[e], proj, dtype))


@pytest.mark.parametrize("slots", [4, 6])
def test_slot_table_path_equals_resident_bitwise(checkpoint, slots, gather_on_cpu):
    """Decode through published slot tables, with evictions all along, gives resident's bits.
    (A call that must stream, e.g. a prefill missing most experts, is computed expert by expert
    instead, which is not bitwise the gathered kernel: prefill is 1 token here.)"""
    resident = our_logits(load_ours(checkpoint), IDS, prefill=1)
    model = load_ours(checkpoint, strategy="offload", cache=CacheSizing("size", slots))
    assert torch.equal(our_logits(model, IDS, prefill=1), resident)
    stats = offload_stats(model)
    assert stats is not None and stats["misses"] > slots and stats["hits"] > 0


@pytest.mark.parametrize("gate_up", ["q8_0", "q5_0"])
def test_fused_slots_close_to_resident(tiny_qwen3_moe, tmp_path, gather_on_cpu, gate_up):
    """Decode with the fused kernels reading the slots in place (Triton's interpreter here)
    follows resident, which dequantised the same blocks at load, with evictions all along."""
    pytest.importorskip("triton")
    from freetoken.moe.offload import OffloadExperts

    def fmt(name: str, shape: tuple[int, ...]) -> str:
        if ".experts." not in name:
            return "f32"
        return "q8_0" if "down" in name else gate_up

    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q.gguf", fmt)
    resident = our_logits(load_ours(path), IDS, prefill=1)
    model = load_ours(path, strategy="offload", cache=CacheSizing("size", 4))
    layers = [m for m in model.modules() if isinstance(m, OffloadExperts)]
    assert {m.bank.layout.formats for m in layers} == {(gate_up, gate_up, "q8_0")}
    for m in layers:
        m.gpu_kernel = "fused"
    fused = our_logits(model, IDS, prefill=1)
    torch.testing.assert_close(fused, resident, rtol=1e-4, atol=1e-4)
    stats = offload_stats(model)
    assert stats is not None and stats["misses"] > 4 and stats["hits"] > 0


def test_a_fused_kernel_that_fails_to_build_falls_back(tiny_qwen3_moe, tmp_path, gather_on_cpu,
                                                       monkeypatch, caplog):
    """A Triton error (e.g. an unsupported GPU) is a warning and the slow twin's numbers; any
    other error still propagates."""
    from freetoken.moe import offload

    class CompilationError(Exception):
        pass

    CompilationError.__module__ = "triton.compiler.errors"

    def broken(*args, **kwargs):
        raise CompilationError("at 12:4: unsupported layout")

    path = convert_to_gguf(open_checkpoint(tiny_qwen3_moe), tmp_path / "q8.gguf",
                           lambda n, s: "q8_0" if ".experts." in n else "f32")
    monkeypatch.setattr(offload, "gathered_fused", broken)
    resident = our_logits(load_ours(path), IDS, prefill=1)
    model = load_ours(path, strategy="offload", cache=CacheSizing("size", 4))
    layers = [m for m in model.modules() if isinstance(m, offload.OffloadExperts)]
    for m in layers:
        m.gpu_kernel = "fused"
    assert torch.equal(our_logits(model, IDS, prefill=1), resident)
    assert all(m.gpu_kernel == "dequant" for m in layers)
    assert "the fused q8_0/q8_0/q8_0 kernel failed to build (CompilationError" in caplog.text
    # a plain error raised inside triton (its launcher's C compiler, the GPU's assembler)
    namespace: dict = {}
    exec(compile("def build(*a, **k):\n    raise RuntimeError('cc failed')\n",
                 "/site-packages/triton/runtime/build.py", "exec"), namespace)
    monkeypatch.setattr(offload, "gathered_fused", namespace["build"])
    layers[0].gpu_kernel = "fused"
    assert torch.equal(our_logits(model, IDS, prefill=1), resident)
    assert layers[0].gpu_kernel == "dequant" and "(RuntimeError: cc failed)" in caplog.text
    monkeypatch.setattr(offload, "gathered_fused", lambda *a, **k: 1 / 0)
    layers[0].gpu_kernel = "fused"
    with pytest.raises(ZeroDivisionError):
        our_logits(model, IDS, prefill=1)


def test_gpu_expert_kernel_choice(tiny_qwen3_moe, monkeypatch):
    from freetoken.moe.attach import choose_gpu_kernels
    from freetoken.moe.offload import OffloadExperts

    monkeypatch.setenv("FREETOKEN_GPU_EXPERT_KERNEL", "fast")
    with pytest.raises(ConfigError, match="FREETOKEN_GPU_EXPERT_KERNEL='fast' is not one of"):
        load_ours(tiny_qwen3_moe, strategy="offload", cache=CacheSizing("size", 4))
    monkeypatch.setenv("FREETOKEN_GPU_EXPERT_KERNEL", "fused")
    model = load_ours(tiny_qwen3_moe, strategy="offload", cache=CacheSizing("size", 4))
    layers = [m for m in model.modules() if isinstance(m, OffloadExperts)]
    with pytest.raises(ConfigError, match="no layer's experts are all in q8_0"):  # f32 here
        choose_gpu_kernels(layers, torch.device("cuda"))


def test_published_table_masks_what_it_does_not_hold(tiny_qwen3_moe, gather_on_cpu):
    """A pair whose expert is not in the published table counts 0; the held ones compute as
    resident does for them alone."""
    from freetoken.moe.offload import OffloadExperts
    from freetoken.moe.resident import ResidentExperts

    model = load_ours(tiny_qwen3_moe, strategy="offload", cache=CacheSizing("size", 6))
    ref = load_ours(tiny_qwen3_moe)
    off = next(m for m in model.modules() if isinstance(m, OffloadExperts))
    res = next(m for m in ref.modules() if isinstance(m, ResidentExperts)
               and m.shape.layer == off.shape.layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, off.shape.hidden, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2, generator=g)
    layer, pool = off.shape.layer, off.runtime.cache.pool(off.shape.layer)
    assert off._plan(x, ids, w) is None  # every needed expert fetched, table published
    held = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    assert torch.equal(off._from_table(x, ids, w), res(x, ids, w * held))
    pool.tables[layer][1] = -1  # expert 1 leaves the table the device reads
    pool.publish(layer)
    held = (ids != 1).float()
    assert torch.equal(off._from_table(x, ids, w), res(x, ids, w * held))
    pool.publish(layer, empty=True)
    assert torch.equal(off._from_table(x, ids, w), torch.zeros_like(x))


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["dequant", "auto"])
@pytest.mark.parametrize("prefill", [1, 70])
def test_offload_on_cuda_equals_resident_bitwise(checkpoint, prefill, kernel, monkeypatch):
    """Decode calls (2 pairs: both gather) and a 70-token prefill (140 pairs: both group).
    Bit for bit with the dequantise + matmul kernel; the fused one (auto, on Q8_0 slots) sums
    in another order, so it is close. Resident keeps the file's blocks here (offload's)."""
    monkeypatch.setenv("FREETOKEN_GPU_EXPERT_KERNEL", kernel)
    monkeypatch.setenv("FREETOKEN_RESIDENT_BLOCKS", "file")
    ids = (IDS * 4)[: prefill + 20]
    n = 128  # rotary positions past the 90 tokens
    resident = our_logits(load_ours(checkpoint, torch.bfloat16, "cuda", max_seq_len=n), ids,
                          prefill, "cuda")
    model = load_ours(checkpoint, torch.bfloat16, "cuda", "offload", CacheSizing("size", 3),
                      max_seq_len=n)
    offload = our_logits(model, ids, prefill, "cuda")
    fused = any(getattr(m, "gpu_kernel", "") == "fused" for m in model.modules())
    assert fused == (kernel == "auto" and checkpoint.name in ("q8_0.gguf", "mixed.gguf"))
    if fused:
        torch.testing.assert_close(offload.float(), resident.float(), atol=5e-2, rtol=5e-2)
    else:
        assert torch.equal(offload, resident)
    stats = offload_stats(model)
    assert stats is not None and stats["misses"] > 3 and stats["fetch_s"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("strategy,kernel", [("offload", "dequant"), ("offload", "fused"),
                                             ("hybrid", "auto"), ("hybrid-fetching", "dequant"),
                                             ("offload-flags", "dequant"),
                                             ("hybrid-flags", "auto"),
                                             ("offload-early", "dequant"),
                                             ("hybrid-early", "auto"),
                                             ("hybrid-lateflags", "auto"),
                                             ("hybrid-earlylateflags", "auto")])
def test_decode_graphs_around_host_planned_experts(tmp_path, monkeypatch, strategy, kernel):
    """Captured pieces with the experts planned between them: offload with the dequantise +
    matmul kernel gives eager resident's logits bit for bit; with the fused kernel, and hybrid,
    within tolerance. Hybrid's steps that fetch every miss (here greedy ones) run the graphs
    captured for them, without a late step, and give resident's logits bit for bit too. With
    the plans inside the graph on flags (FREETOKEN_HOST_STEPS=flags) a step is one piece, and
    gives the same logits; so do pieces launched by the plan before it is through
    (FREETOKEN_HOST_STEPS=early), which some plans are, and the CPU's results awaited on flags
    inside the pieces (FREETOKEN_LATE_STEPS=flags: no late step between pieces)."""
    from freetoken.config import EngineConfig
    from freetoken.cpu.graph_flags import FlagJobs
    from freetoken.engine.runner import ModelRunner
    from freetoken.layers.context import Segment
    from freetoken.moe.host_steps import HostStep, LateStep

    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    monkeypatch.setenv("FREETOKEN_GPU_EXPERT_KERNEL", kernel)
    model = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, "-m", "freetoken.cli", "synth", "--preset", "tiny",
                    "--expert-format", "q8_0", "--out", str(model)], check=True,
                   capture_output=True, timeout=300)
    logits = {}
    fetching = strategy == "hybrid-fetching"
    flagged = strategy.endswith("-flags")
    early = strategy.endswith("-early") or strategy.endswith("-earlylateflags")
    late_flags = strategy.endswith("lateflags")
    monkeypatch.setenv("FREETOKEN_HOST_STEPS",
                       "flags" if flagged else "early" if early else "pieces")
    monkeypatch.setenv("FREETOKEN_LATE_STEPS", "flags" if late_flags else "breaks")
    launched: list[bool] = []  # early: whether each plan launched the next piece
    strategy = strategy.split("-")[0]
    ran: list[str] = []  # the host's steps between pieces, in the fetching graphs' run
    for name, strat, graphs in (("eager", "resident", 0), ("graphs", strategy, 4)):
        cfg = EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                           moe_strategy=strat, max_seq_len=256, cuda_graph_max_bs=graphs,
                           moe_cpu_threads=1, moe_cache=CacheSizing("size", 5),
                           moe_hybrid_max_fetch=1, moe_hybrid_online=False)
        runner = ModelRunner(cfg, kv_tokens=512, progress=False)
        if graphs:
            assert runner.graphs is not None
            g = runner.graphs.graphs[1]
            # 2 MoE layers -> 3 pieces; hybrid waits for the CPU between two more, except in
            # the graphs of steps that fetch every miss; on flags, one piece and the steps
            assert g.split is not None and len(g.split.pieces) == (
                1 if flagged else 3 if strategy == "offload" or late_flags else 5)
            assert (g.fetching is None) == (strategy == "offload")
            assert g.fetching is None or len(g.fetching.pieces) == (1 if flagged else 3)
            if flagged:
                assert isinstance(g.split.nodes, FlagJobs)
                assert len(g.split.nodes.steps) == (2 if strategy == "offload" else 4)
            lates = [b for b in g.split.breaks if isinstance(b, LateStep)]
            if lates:  # the first late step prepares the second layer's plan, the last none
                assert lates[0].then is g.split.breaks[2] and lates[-1].then is None
            if late_flags:  # the two late steps
                assert isinstance(g.split.nodes, FlagJobs) and len(g.split.nodes.steps) == 2
            if fetching:
                runner.greedy_step(True)
                layers = runner.graphs.late
                assert layers and all(m.fetches_next_step() for m in layers)
                for step in (HostStep, LateStep):
                    monkeypatch.setattr(step, "run", lambda self, n, run=step.run, seen=ran: (
                        seen.append(type(self).__name__), run(self, n))[1])
            if early:
                monkeypatch.setattr(HostStep, "run", lambda self, n, launch=None,
                                    run=HostStep.run, seen=launched: (
                                        seen.append(run(self, n, launch)), seen[-1])[1])
        before = offload_stats(runner.model) if fetching else None  # after the capture's
        pages = runner.kv.allocate(runner.pages_for(len(IDS)))
        # each step's logits are copied out: with graphs they live in a static buffer
        logits[name] = torch.cat([runner.forward([[t]], [Segment(pages, i, 1)]).float().cpu()
                                  for i, t in enumerate(IDS)])
    if fetching:  # every step in the fetching graphs: two plans, no late step
        assert ran == ["HostStep"] * (2 * len(IDS))
        assert runner.graphs is not None and runner.graphs.fetching_steps == len(IDS)
        stats = offload_stats(runner.model)
        assert stats is not None and before is not None
        assert stats["cpu_experts"] == before["cpu_experts"]  # the CPU got none of the steps'
        assert stats["misses"] > before["misses"]
    if early:
        assert any(launched) and len(launched) >= 2 * len(IDS)
    if kernel == "dequant":
        assert torch.equal(logits["graphs"], logits["eager"])
    else:
        torch.testing.assert_close(logits["graphs"], logits["eager"], atol=5e-2, rtol=5e-2)
