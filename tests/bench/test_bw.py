"""``ft bench bw`` end to end on the CPU: rows per layer kind of a mixed-format GGUF, merging
into the profile, bad input, thread resolution, and the synthetic banks it benches on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import pytest
import torch

from freetoken.bench import bandwidth as bw
from freetoken.bench import decode_run
from freetoken.bench.bw import CANONICAL, Target, bench_kinds, collect_targets, decode_check
from freetoken.cli import build_parser, main
from freetoken.cpu import executor as cx
from freetoken.cpu.cores import usable_cores
from freetoken.errors import ConfigError
from freetoken.moe.profile import LayerKind, Row, cpu_format, load_profile
from freetoken.quant import get_format

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

FAST = ["--device", "cpu", "--threads", "1", "--seconds", "0.05", "--experts", "8"]
Q8_TINY = "gguf[down_type=8,gate_up_type=8]:64x32:top2:t1"
BF16_TINY = "bf16:64x32:top2:t1"
META = {"isa", "cores", "activation", "gpu", "cpu_model", "sources", "threshold", "time",
        "commit", "device", "experts", "kernels"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two MoE layers: layer 0 q8_0 experts, layer 1 bf16."""
    out = tmp_path_factory.mktemp("benchbw") / "tiny-mixed.gguf"
    rc = main(["synth", "--preset", "tiny", "--expert-format", "q8_0,bf16", "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture
def bw_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "benchbw.json"
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(path))
    return path


def rows_of(path: Path) -> dict[str, dict]:
    return json.loads(path.read_text())["layer_kinds"]


def test_model_rows_per_layer_kind(mixed_gguf: Path, bw_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "bw", "--model", str(mixed_gguf), *FAST]) == 0
    rows = rows_of(bw_path)
    assert set(rows) == {Q8_TINY, BF16_TINY}
    for row in rows.values():
        for name in ("cpu_gbps", "pcie_gbps", "cpu_overlapped_gbps", "pcie_overlapped_gbps"):
            assert row[name] > 0
        assert META <= set(row["meta"])
        assert row["meta"]["sources"] == [str(mixed_gguf)]
        assert row["meta"]["experts"] == 8 and row["meta"]["device"] == "cpu"
        assert row["meta"]["activation"] == "silu" and len(row["meta"]["cores"]) == 1
    out = capsys.readouterr().out
    assert "Layer kind" in out and Q8_TINY in out and BF16_TINY in out
    assert f"wrote 2 rows to {bw_path}" in out
    assert set(load_profile(bw_path).rows) == {Q8_TINY, BF16_TINY}


def test_rerun_merges_and_replaces(mixed_gguf: Path, bw_path: Path) -> None:
    assert main(["bench", "bw", "--model", str(mixed_gguf), *FAST]) == 0
    before = rows_of(bw_path)
    assert main(["bench", "bw", "--dtype", "bf16", *FAST]) == 0
    after = rows_of(bw_path)
    assert set(after) == {Q8_TINY, BF16_TINY, "bf16:2048x768:top8:t1"}
    assert after[Q8_TINY] == before[Q8_TINY] and after[BF16_TINY] == before[BF16_TINY]
    assert after["bf16:2048x768:top8:t1"]["meta"]["sources"] == ["dtype:bf16"]
    # the tiny preset's experts are bf16 at the same shape: that row is replaced, not added
    assert main(["bench", "bw", "--preset", "tiny", "--out", str(bw_path), *FAST]) == 0
    last = rows_of(bw_path)
    assert set(last) == set(after) and last[Q8_TINY] == before[Q8_TINY]
    assert last[BF16_TINY]["meta"]["sources"] == ["preset:tiny"]


def test_out_flag_writes_elsewhere(bw_path: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere" / "bw.json"
    assert main(["bench", "bw", "--preset", "tiny", "--out", str(other), *FAST]) == 0
    assert set(rows_of(other)) == {BF16_TINY} and not bw_path.exists()


def test_threads_resolve_like_serving(bw_path: Path) -> None:
    target = collect_targets(presets=["tiny"])
    rows = bench_kinds(target, threads=0, device="cpu", seconds=0.02, experts=8)
    workers = len(cx.plan_cores(usable_cores(), None))  # what `ft serve` starts with flag 0
    assert list(rows) == [f"bf16:64x32:top2:t{workers}"]
    assert len(rows[f"bf16:64x32:top2:t{workers}"].meta["cores"]) == workers


def test_threads_for_every_core_shrink_as_the_served_pool_does(
        bw_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """--threads equal to the usable cores would leave the main thread none: the bench's pool
    is cut as `ft serve`'s is (the core plan), and its row keyed by that pool's workers, so
    that auto finds the row on the box it was measured on."""
    from freetoken.cpu.cores import core_plan

    usable = usable_cores()
    if len(usable) < 2:
        pytest.skip("one usable core: the pool shares it and nothing is cut")
    served = core_plan(usable, True, len(usable))  # what plan_moe starts with that flag
    with caplog.at_level("WARNING", logger="freetoken.bench.bw"):
        rows = bench_kinds(collect_targets(presets=["tiny"]), threads=len(usable),
                           device="cpu", seconds=0.02, experts=8)
    assert list(rows) == [f"bf16:64x32:top2:t{len(served.workers)}"]
    assert len(served.workers) == len(usable) - 1
    assert served.shrink_note() in caplog.text


def test_help_documents_thread_resolution(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside flag names
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "bw", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads N, --moe-cpu-threads N" in text
    assert "resolved exactly as `ft serve --moe-cpu-threads`" in text
    assert "one worker per usable core (affinity mask and cgroup quota) but the first" in text
    assert "keyed t<workers>" in text and "pass the same N to both" in text


def test_no_input_benches_every_cpu_format_at_the_canonical_shape() -> None:
    targets = collect_targets()
    assert len(targets) == len(cx.EXPERT_FORMATS)
    assert {t.sources[0] for t in targets} == {f"dtype:{f}" for f in cx.EXPERT_FORMATS}
    assert {(t.kind.hidden, t.kind.moe_intermediate, t.kind.top_k) for t in targets} == {
        (2048, 768, 8)}
    assert collect_targets(dtypes=["all"]) == targets
    assert CANONICAL == "qwen3-30b-a3b"


def test_presets_and_models_share_kinds(mixed_gguf: Path) -> None:
    targets = collect_targets(models=[str(mixed_gguf)], presets=["tiny", "gemma4-26b-a4b"])
    by_key = {t.kind.key(1): t for t in targets}
    assert by_key[BF16_TINY].sources == [str(mixed_gguf), "preset:tiny"]
    assert by_key[Q8_TINY].sources == [str(mixed_gguf)]
    assert {"gguf[down_type=8,gate_up_type=8]:2816x704:top8:t1",
            "bf16:2816x704:top8:t1"} <= set(by_key)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "bf17"], "unknown --dtype 'bf17' (choose from all, f32, f16, bf16, q8_0"),
        (["--preset", "qwen9"], "unknown --preset 'qwen9' (choose from qwen3-30b-a3b,"),
        (["--model", "/nonexistent/model.gguf"], "model '/nonexistent/model.gguf' not found"),
        (["--preset", "tiny", "--experts", "1"], "--experts 1 is fewer than top-k 2"),
        (["--preset", "tiny", "--seconds", "0"], "--seconds must be positive"),
        (["--preset", "tiny", "--threads", "-1"], "--threads must be >= 0"),
        (["--preset", "tiny", "--decode-check", "4GB"],
         "--decode-check decodes the checkpoints given with --model; pass one"),
        (["--model", "/nonexistent/model.gguf", "--decode-check", "4GB", "--decode-tokens", "0"],
         "--decode-tokens must be at least 1"),
    ],
)
def test_bad_input_is_one_line(argv: list[str], message: str, bw_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    defaults = [a for flag, value in zip(FAST[::2], FAST[1::2], strict=True)
                if flag not in argv for a in (flag, value)]
    assert main(["bench", "bw", *argv, *defaults]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ft bench: error: ") and message in err and "Traceback" not in err
    assert not bw_path.exists()


def test_decode_check_size_is_checked_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "bw", "--model", "m.gguf", "--decode-check", "lots"])
    assert "'lots' is not a size; write it like 4GB" in capsys.readouterr().err


def test_decode_check_runs_the_model_per_recommended_strategy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode check loads the model itself in a child process per strategy (the real
    engine on the CPU here) and records offload's, hybrid's and cpu's figures in every row
    of that model (its row recommends hybrid); rows of a model that recommend offload get
    none, and a run that fails or is stuck names its strategy and the child's last lines."""
    model = tmp_path / "tiny-q8.gguf"
    assert main(["synth", "--preset", "tiny", "--expert-format", "q8_0", "--out",
                 str(model)]) == 0
    hybrid = Row(100.0, 31.5, 90.0, 30.0, {"sources": [str(model)]})
    offload = Row(40.0, 50.0, 3.0, 49.0, {"sources": ["other.gguf"]})
    profile = tmp_path / "benchbw.json"
    rows = decode_check({"a": hybrid, "b": offload}, [str(model), "other.gguf"], "cpu", 1,
                        1_000_000, 8, profile)
    check = rows["a"].decode
    assert check is not None and set(check.tokens_per_s) == {"offload", "hybrid", "cpu"}
    assert all(v > 0 for v in check.tokens_per_s.values())
    assert (check.model, check.cache_bytes, check.tokens) == (str(model), 1_000_000, 8)
    assert rows["a"].cpu_gbps == 100.0 and rows["b"] is offload
    monkeypatch.setattr(decode_run, "CHILD_TIMEOUT_S", 0.5)  # a stuck run is stopped
    with pytest.raises(ConfigError, match=r"offload run of .*tiny-q8.gguf did not finish in "
                       r"0.5 s and was stopped"):
        decode_check({"a": hybrid}, [str(model)], "cpu", 1, 1_000_000, 8, profile)
    monkeypatch.undo()
    gone = Row(100.0, 31.5, 90.0, 30.0, {"sources": [str(tmp_path / "gone.gguf")]})
    with pytest.raises(ConfigError, match="decode check's offload run of .*gone.gguf failed"):
        decode_check({"a": gone}, [str(tmp_path / "gone.gguf")], "cpu", 1, 1_000_000, 8,
                     profile)


def test_cuda_without_a_gpu(bw_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["bench", "bw", "--preset", "tiny", "--device", "cuda"]) == 2
    assert "--device cuda but no CUDA GPU is visible" in capsys.readouterr().err


def test_dense_checkpoint_has_nothing_to_bench(tiny_gemma3: Path, bw_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "bw", "--model", str(tiny_gemma3), *FAST]) == 2
    assert "no MoE layers, so there is nothing to bench" in capsys.readouterr().err


def test_kind_without_cpu_kernel_is_skipped(bw_path: Path, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    odd = Target(LayerKind("ds_fp4", 64, 32, 2), 8, "silu", ["preset:odd"])
    relu = Target(LayerKind("bf16", 64, 64, 2), 8, "relu2", ["preset:relu"])
    ok = collect_targets(presets=["tiny"])
    with caplog.at_level(logging.WARNING, logger="freetoken.bench.bw"):
        rows = bench_kinds([odd, relu, *ok], threads=1, device="cpu", seconds=0.02, experts=8)
    assert list(rows) == [BF16_TINY]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "skipping layer kind ds_fp4:64x32:top2 (from preset:odd): no CPU kernel for ds_fp4" \
        in warned
    assert "skipping layer kind bf16:64x64:top2 (from preset:relu): no CPU kernel for the " \
        "activation 'relu2'" in warned


def test_nothing_benchable_is_an_error(monkeypatch: pytest.MonkeyPatch, bw_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cx, "FORMATS", ("q8_0",))
    assert main(["bench", "bw", "--preset", "tiny", *FAST]) == 2
    err = capsys.readouterr().err
    assert "no layer kind could be benched" in err and not bw_path.exists()


KIND_FORMATS = ["bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k", "mxfp4", "nvfp4", "fp8_block"]


@pytest.mark.parametrize("fmt", KIND_FORMATS)
def test_synthetic_banks_have_unit_scales(fmt: str) -> None:
    name, options = cpu_format(fmt, fmt, fmt)
    kind = LayerKind(name, 256, 512, 2, options)
    assert bw.projection_formats(kind) == (fmt,) * 3
    bank = bw.synthetic_bank(kind, 6, 6, pinned=False)
    assert bank.rows.shape == (6, bank.layout.row_bytes)
    q = get_format(fmt)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w = bank.layout.weight(bank.rows[5], proj, torch.float32)
        assert torch.isfinite(w).all() and (w != 0).float().mean() > 0.5
        if q.gguf_type is not None and q.block_size > 1:
            raw = bank.layout.quant(bank.rows[5], proj).data.numpy()
            ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(q.gguf_type))
            assert torch.equal(w, torch.from_numpy(ref.reshape(w.shape)).float())
        if fmt in ("q8_0", "q4_0", "q5_0", "q6_k"):  # scale 1: small integers
            assert torch.equal(w, w.round()) and w.abs().max() <= 128 * 128
        if fmt in ("mxfp4", "nvfp4"):  # scale 1: the e2m1 grid itself
            assert w.abs().max() <= 6
    # the bank repeats the distinct experts at their own addresses
    assert torch.equal(bank.rows[0], bank.rows[bw.DISTINCT])
    assert not torch.equal(bank.rows[0], bank.rows[1])


def test_cpu_bytes_are_the_distinct_experts_read() -> None:
    fmt, options = cpu_format("q8_0", "q8_0", "q8_0")
    kind = LayerKind(fmt, 96, 160, 4, options)
    bank = bw.synthetic_bank(kind, 16, 16, pinned=False)
    ex = cx.CpuMoeExecutor(threads=1)
    try:
        bench = bw.LayerBench(kind, bank, ex, torch.device("cpu"))
        for call in bench.calls[:8]:
            fut = ex.submit(call.hidden, call.ids, call.weights, 0)
            assert torch.isfinite(fut.wait()).all()
            assert fut.weight_bytes == len(call.experts) * cx.expert_bytes("q8_0", 96, 160)
        assert {c.hidden.shape[0] for c in bench.calls} == set(bw.BATCHES)
        assert all(len(set(row.tolist())) == 4 for c in bench.calls for row in c.ids)
        got = bench.measure(0.02)
        assert min(got.cpu_gbps, got.pcie_gbps, got.cpu_overlapped_gbps,
                   got.pcie_overlapped_gbps) > 0
    finally:
        ex.close()


def test_working_set_is_several_times_the_l3() -> None:
    assert bw.working_set_experts(1 << 20, 128, l3=8 << 20) == 128  # the layer has enough
    assert bw.working_set_experts(1 << 20, 8, l3=32 << 20) == bw.WORKING_SET_L3 * 32


def test_projection_formats_of_split_and_mixed_kinds() -> None:
    fmt, opts = cpu_format("q4_k", "q5_0", "q6_k")
    assert bw.projection_formats(LayerKind(fmt, 256, 256, 2, opts)) == ("q4_k", "q5_0", "q6_k")
    fmt, opts = cpu_format("bf16", "bf16", "nvfp4")
    assert bw.projection_formats(LayerKind(fmt, 64, 64, 2, opts)) == ("bf16", "bf16", "nvfp4")


@pytest.mark.cuda
def test_gather_on_the_copy_stream(bw_path: Path) -> None:
    rows = bench_kinds(collect_targets(presets=["tiny"]), threads=1, device="cuda",
                       seconds=0.05, experts=8)
    row = rows[BF16_TINY]
    assert row.meta["device"] == "cuda" and row.meta["gpu"] == torch.cuda.get_device_name()
    assert min(row.cpu_gbps, row.pcie_gbps, row.cpu_overlapped_gbps,
               row.pcie_overlapped_gbps) > 0
