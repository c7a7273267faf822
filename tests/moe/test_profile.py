"""The bandwidth profile: row keys, layer kinds of real checkpoints, file I/O, startup lookup."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as GGML

from freetoken.checkpoint import TensorInfo, open_checkpoint
from freetoken.checkpoint.synth import resolve_spec, write_synth
from freetoken.config import ModelConfig
from freetoken.errors import CheckpointError, ConfigError
from freetoken.moe.decode_check import DecodeCheck
from freetoken.moe.profile import (
    FETCH_CAP,
    LayerKind,
    Profile,
    ProfileError,
    Row,
    cpu_format,
    format_table,
    layer_kinds,
    layer_kinds_from_formats,
    load_profile,
    load_profile_or_empty,
    lookup,
    parse_key,
    plan_fractions,
    profile_path,
    save_rows,
)

Q8 = str(int(GGML.Q8_0))
Q8_KIND = LayerKind("gguf", 2816, 704, 8, (("down_type", Q8), ("gate_up_type", Q8)))
BF16 = LayerKind("bf16", 2048, 768, 8)


def row(cpu_ov: float = 90.0, pcie_ov: float = 30.0, **meta: object) -> Row:
    return Row(100.0, 31.5, cpu_ov, pcie_ov, meta)


@pytest.fixture
def bw_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "profiles" / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(path))
    return path


def test_key_format_and_round_trip():
    assert Q8_KIND.key(12) == "gguf[down_type=8,gate_up_type=8]:2816x704:top8:t12"
    assert BF16.key(15) == "bf16:2048x768:top8:t15"
    for kind, threads in [(Q8_KIND, 12), (BF16, 15), (LayerKind("nvfp4", 64, 32, 2), 1)]:
        assert parse_key(kind.key(threads)) == (kind, threads)


@pytest.mark.parametrize("key", [
    "bf16:2048x768:top8", "bf16:2048x768:top8:t0", "bf16:02048x768:top8:t15",
    "gguf[down_type]:2816x704:top8:t12", "gguf[gate_up_type=8,down_type=8]:2816x704:top8:t12",
    "gguf[]:2816x704:top8:t12", "bf16:2048x768:top0:t15", "bf 16:2048x768:top8:t15",
])
def test_bad_key_is_named(key: str):
    with pytest.raises(ValueError, match="bad bandwidth profile key") as e:
        parse_key(key)
    assert repr(key) in str(e.value)


def test_cpu_format_rule():
    q8, q6, mx = (str(int(t)) for t in (GGML.Q8_0, GGML.Q6_K, GGML.MXFP4))
    assert cpu_format("q8_0", "q8_0", "q8_0") == (
        "gguf", (("down_type", q8), ("gate_up_type", q8)))
    assert cpu_format("q8_0", "q8_0", "q6_k") == (
        "gguf", (("down_type", q6), ("gate_up_type", q8)))
    assert cpu_format("mxfp4", "mxfp4", "mxfp4")[1] == (("down_type", mx), ("gate_up_type", mx))
    # f16 is kept as bf16 by the CPU path, so a q8_0 layer with an f16 down keys bf16's type
    assert cpu_format("q8_0", "q8_0", "f16")[1][0] == ("down_type", str(int(GGML.BF16)))
    assert cpu_format("q4_k", "q5_0", "q4_k")[1] == (
        ("down_type", str(int(GGML.Q4_K))), ("gate_type", str(int(GGML.Q4_K))),
        ("up_type", str(int(GGML.Q5_0))))
    for fmt, want in [("bf16", "bf16"), ("f16", "bf16"), ("f32", "bf16"),
                      ("fp8_block", "fp8_block"), ("nvfp4", "nvfp4")]:
        assert cpu_format(fmt, fmt, fmt) == (want, ())
    assert cpu_format("fp8_block", "fp8_block", "bf16")[0] == "mixed"


def test_layer_kinds_from_formats_groups_moe_layers():
    cfg = _config(moe_layers=(True, False, True, True))
    q8 = dict.fromkeys(("gate_proj", "up_proj", "down_proj"), "q8_0")
    kinds = layer_kinds_from_formats(cfg, {0: q8, 2: {**q8, "down_proj": "bf16"}, 3: q8})
    assert {k.key(4): v for k, v in kinds.items()} == {
        f"gguf[down_type={Q8},gate_up_type={Q8}]:64x32:top2:t4": [0, 3],
        f"gguf[down_type={int(GGML.BF16)},gate_up_type={Q8}]:64x32:top2:t4": [2],
    }
    with pytest.raises(CheckpointError, match="MoE layer 3 has no expert tensor for down_proj"):
        layer_kinds_from_formats(cfg, {0: q8, 2: q8, 3: {"gate_proj": "q8_0", "up_proj": "q8_0"}})


def test_layer_kinds_of_a_mixed_format_gguf(tmp_path: Path):
    torch.manual_seed(0)
    spec = resolve_spec("tiny", gguf=True, expert_format="q8_0*2,bf16", layers=3)
    ckpt = open_checkpoint(write_synth(spec, tmp_path / "mixed.gguf"))
    kinds = {k.key(12): v for k, v in layer_kinds(ckpt).items()}
    q8 = int(GGML.Q8_0)
    assert kinds == {f"gguf[down_type={q8},gate_up_type={q8}]:64x32:top2:t12": [0, 1],
                     "bf16:64x32:top2:t12": [2]}


def test_layer_kinds_of_an_hf_directory(tmp_path: Path):
    ckpt = open_checkpoint(write_synth(resolve_spec("tiny", gguf=False), tmp_path / "hf"))
    assert {k.key(3): v for k, v in layer_kinds(ckpt).items()} == {"bf16:64x32:top2:t3": [0, 1]}


class _FakeCheckpoint:
    """Names and formats only: enough for layer_kinds."""

    def __init__(self, tensors: list[tuple[str, str]]) -> None:
        self.path = Path("fake")
        self.config = _config(moe_layers=(True, True))
        self._tensors = tensors

    def tensor_infos(self) -> Iterator[TensorInfo]:
        for name, fmt in self._tensors:
            yield TensorInfo(name, fmt, (1,), 0)


def test_layer_kinds_of_fused_and_per_expert_names():
    pre = "model.layers.{}.mlp.experts."
    ckpt = _FakeCheckpoint([(pre.format(0) + "gate_up_proj", "fp8_block"),
                            (pre.format(0) + "down_proj", "fp8_block"),
                            *((pre.format(1) + f"{e}.{p}.weight", "f16")
                              for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")),
                            ("model.layers.1.self_attn.q_proj.weight", "q8_0")])
    assert {k.key(1): v for k, v in layer_kinds(ckpt).items()} == {
        "fp8_block:64x32:top2:t1": [0], "bf16:64x32:top2:t1": [1]}
    ckpt._tensors[-2] = (pre.format(1) + "1.down_proj.weight", "q8_0")
    with pytest.raises(CheckpointError, match="layer 1 down_proj has experts in several formats"):
        layer_kinds(ckpt)


def test_row_fraction_recommendation_and_table():
    r = Row(101.6, 31.5, 89.1, 31.1)
    assert r.fraction == pytest.approx(31.1 / 120.2)
    assert r.recommended == "hybrid"
    assert Row(40.0, 50.0, 3.0, 49.0).recommended == "offload"  # CPU adds < 10% over PCIe
    assert Row(130.0, 30.0, 80.0, 30.0).recommended == "cpu"  # the CPU alone is faster
    assert Row(130.0, 50.0, 100.0, 40.0).recommended == "cpu"  # overlapped adds < 10 %
    assert Row(60.0, 50.0, 30.0, 30.0).recommended == "offload"  # the CPU not 50 % faster
    table = format_table({Q8_KIND.key(12): r}).splitlines()
    assert table[0].split("  ")[0] == "Layer kind" and "Overlapped CPU / PCIe" in table[0]
    assert table[1].split() == [Q8_KIND.key(12), "101.6", "31.5", "89.1", "/", "31.1",
                                "25.9%", "hybrid"]
    with pytest.raises(ValueError, match="pcie_overlapped_gbps must be a positive"):
        Row(1.0, 1.0, 1.0, 0.0)


def test_lookup_exact_nearest_shape_nearest_threads(caplog: pytest.LogCaptureFixture):
    near, far = LayerKind("bf16", 2048, 704, 8), LayerKind("bf16", 4096, 1536, 8)
    rows = {near.key(12): row(pcie_ov=20.0), far.key(12): row(pcie_ov=40.0),
            BF16.key(8): row(pcie_ov=30.0), BF16.key(16): row(pcie_ov=35.0),
            Q8_KIND.key(12): row()}
    profile = Profile(Path("p.json"), rows)
    caplog.set_level(logging.INFO, logger="freetoken.moe.profile")

    m = lookup(profile, BF16, 8)
    assert (m.how, m.used, m.fraction, m.max_fetch) == ("exact", BF16.key(8), 0.25, None)
    assert not caplog.records

    m = lookup(profile, BF16, 12)
    assert (m.how, m.wanted, m.used, m.row) == ("nearest_shape", BF16.key(12), near.key(12),
                                                rows[near.key(12)])
    assert "nearest shape" in caplog.text and caplog.records[-1].levelno == logging.INFO

    # 10 threads: 8 and 12 are both 2 away; the tie goes to fewer threads
    m = lookup(profile, BF16, 10)
    assert (m.how, m.used) == ("nearest_threads", BF16.key(8))
    assert lookup(profile, BF16, 15).used == BF16.key(16)
    # nearest thread count first (12), then the nearest shape among its rows
    assert lookup(profile, LayerKind("bf16", 4000, 1536, 8), 13).used == far.key(12)
    assert "nearest thread count" in caplog.text


def test_missing_row_caps_fetch_and_warns(caplog: pytest.LogCaptureFixture):
    profile = Profile(Path("p.json"), {BF16.key(12): row()})
    m = lookup(profile, Q8_KIND, 12, layers=[0, 1, 2, 4], checkpoint="/m/gemma.gguf")
    assert (m.how, m.used, m.row, m.fraction, m.max_fetch) == ("missing", None, None, None,
                                                                FETCH_CAP)
    assert FETCH_CAP == 1
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    assert Q8_KIND.key(12) in rec.getMessage() and "layers 0-2, 4" in rec.getMessage()
    assert "run ft bench bw --model /m/gemma.gguf" in rec.getMessage()
    lookup(profile, Q8_KIND, 3)
    assert "run ft bench bw --model <checkpoint>" in caplog.records[-1].getMessage()


def test_plan_fractions_per_layer(caplog: pytest.LogCaptureFixture):
    profile = Profile(Path("p.json"), {Q8_KIND.key(12): row(cpu_ov=75.0, pcie_ov=25.0)})
    bf16 = LayerKind("bf16", 2816, 704, 8)
    plan = plan_fractions(profile, {Q8_KIND: [0, 1, 3], bf16: [2]}, threads=12)
    assert list(plan) == [0, 1, 2, 3]
    assert [plan[i].fraction for i in (0, 1, 3)] == [0.25] * 3
    assert (plan[2].how, plan[2].max_fetch) == ("missing", 1)
    assert len(caplog.records) == 1 and "bf16:2816x704:top8:t12" in caplog.text


def test_profile_path_from_env_or_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FREETOKEN_BENCHBW_PATH", raising=False)
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))
    assert profile_path() == tmp_path / "cache" / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "bw.json"))
    assert profile_path() == tmp_path / "bw.json"


def test_missing_file_is_empty_and_quiet(bw_path: Path, caplog: pytest.LogCaptureFixture):
    profile = load_profile()
    assert (profile.path, dict(profile.rows)) == (bw_path, {})
    assert not caplog.records


def test_save_merges_and_replaces_benched_rows(bw_path: Path):
    a, b, c = BF16.key(12), Q8_KIND.key(12), BF16.key(8)
    assert save_rows({a: row(sources=["qwen3"]), b: row(cpu_ov=80.0)}) == bw_path
    save_rows({b: row(cpu_ov=70.0), c: row()})
    doc = json.loads(bw_path.read_text())
    assert doc["version"] == 6 and sorted(doc["layer_kinds"]) == sorted([a, b, c])
    rows = load_profile().rows
    assert rows[a].meta == {"sources": ["qwen3"]}
    assert rows[b].cpu_overlapped_gbps == 70.0
    # no temporary file is left behind
    assert sorted(p.name for p in bw_path.parent.iterdir()) == ["benchbw.json",
                                                                 "benchbw.json.lock"]
    with pytest.raises(ValueError, match="bad bandwidth profile key"):
        save_rows({"bf16": row()})


def test_concurrent_saves_keep_every_row(bw_path: Path):
    def bench(worker: int) -> None:
        for i in range(25):
            save_rows({LayerKind("bf16", 64, 32 * (i + 1), 2).key(worker + 1): row()})

    workers = [threading.Thread(target=bench, args=(w,)) for w in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(load_profile().rows) == 75


@pytest.mark.parametrize("text, why", [
    ("{not json", "not JSON"),
    ("[]", "not an object"),
    ('{"version": 6}', "no layer_kinds"),
    ('{"version": 6, "layer_kinds": {"bf16:64x32:top2:t1": {"cpu_gbps": 1}}}', "missing"),
    ('{"version": 6, "layer_kinds": {"bf16": {}}}', "bad bandwidth profile key"),
    ('{"version": 6, "layer_kinds": {"bf16:64x32:top2:t1": {"cpu_gbps": -1, "pcie_gbps": 1,'
     ' "cpu_overlapped_gbps": 1, "pcie_overlapped_gbps": 1}}}', "cpu_gbps must be a positive"),
    ('{"version": 7, "layer_kinds": {}}', "newer"),
    ('{"version": 6, "layer_kinds": {"bf16:64x32:top2:t1": {"cpu_gbps": 1, "pcie_gbps": 1,'
     ' "cpu_overlapped_gbps": 1, "pcie_overlapped_gbps": 1, "decode": {"model": "m",'
     ' "cache_bytes": 4000000000, "tokens": 128, "tokens_per_s": {"hybrid": 30.0}}}}}',
     "needs offload's figure"),
])
def test_unusable_file_names_itself(bw_path: Path, caplog: pytest.LogCaptureFixture, text: str,
                                    why: str):
    bw_path.parent.mkdir()
    bw_path.write_text(text)
    with pytest.raises(ProfileError, match=why) as e:
        load_profile()
    assert isinstance(e.value, ConfigError)
    assert str(bw_path) in str(e.value) and "rerun ft bench bw" in str(e.value)
    assert "delete the file" in str(e.value)
    assert dict(load_profile_or_empty().rows) == {}
    assert caplog.records[-1].levelno == logging.WARNING and str(bw_path) in caplog.text


def test_older_version_is_ignored_with_a_message(bw_path: Path,
                                                 caplog: pytest.LogCaptureFixture):
    bw_path.parent.mkdir()
    bw_path.write_text(json.dumps({"version": 5, "dtype_kernels": {"bf16": {"cpu": 100.0}}}))
    assert dict(load_profile().rows) == {}
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    assert "version 5" in rec.getMessage() and "version 6 is needed" in rec.getMessage()
    assert "rerun ft bench bw" in rec.getMessage()
    save_rows({BF16.key(12): row()})  # a bench run replaces the old file
    assert list(load_profile().rows) == [BF16.key(12)]


def test_a_decode_check_round_trips_with_its_row(bw_path: Path):
    """A row's decode check is saved and read back whole; a row benched again without one
    replaces it (a new measurement of the box drops the old verdict)."""
    check = DecodeCheck("/m/q3.gguf", 4_000_000_000, 128, {"offload": 25.7, "hybrid": 38.5})
    save_rows({BF16.key(12): Row(100.0, 31.5, 90.0, 30.0, {}, check)})
    (back,) = load_profile().rows.values()
    assert back.decode == check and dict(back.decode.tokens_per_s) == dict(check.tokens_per_s)
    assert "offload 25.7, hybrid 38.5 tok/s at 4GB: auto runs hybrid" in format_table(
        {BF16.key(12): back})
    save_rows({BF16.key(12): row()})
    assert load_profile().rows[BF16.key(12)].decode is None
    assert "Decode check" not in format_table(load_profile().rows)


def test_save_moves_a_damaged_file_aside(bw_path: Path, caplog: pytest.LogCaptureFixture):
    bw_path.parent.mkdir()
    bw_path.write_text("{oops")
    save_rows({BF16.key(12): row()})
    assert list(load_profile().rows) == [BF16.key(12)]
    assert (bw_path.parent / "benchbw.json.damaged").read_text() == "{oops"
    assert "benchbw.json.damaged" in caplog.text


def _config(moe_layers: tuple[bool, ...]) -> ModelConfig:
    return ModelConfig(family="qwen3_moe", vocab_size=512, hidden_size=64,
                       num_layers=len(moe_layers), num_heads=4, num_kv_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=1e6, max_position=4096,
                       tie_word_embeddings=False, num_experts=8, top_k=2,
                       moe_intermediate_size=32, moe_layers=moe_layers)
