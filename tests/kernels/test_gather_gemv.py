"""The fused gather-GEMV kernels against the gguf package's dequantisation (float64 math) and
against their slow twin; on the CPU through Triton's interpreter, on the GPU compiled.

nvfp4 (its scales apart from its codes) is laid out as the expert cache holds it: one byte row
a slot, each projection's codes then its scales, 64-byte aligned (:func:`_experts`)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from freetoken.kernels import gemv_launch
from freetoken.moe.host_banks import PROJECTIONS, BankBuilder
from freetoken.quant import QuantTensor, get_format, gguf_quantize, gguf_read
from tests.kernels.conftest import compile_for_sm90

triton = pytest.importorskip("triton")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
GGUF_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q5_0": GGMLQuantizationType.Q5_0,
             "q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
             "q6_k": GGMLQuantizationType.Q6_K, "mxfp4": GGMLQuantizationType.MXFP4}


@pytest.fixture
def kernels(triton_runs):
    """The kernel module, on the CPU only through Triton's interpreter."""
    from freetoken.kernels import gather_gemv

    return gather_gemv


def _pool(slots: int, projections: list[tuple[str, int, int]], seed: int,
          device: str = "cpu") -> list[torch.Tensor]:
    """Byte rows holding ``slots`` experts' projections (format, rows, cols) back to back, one
    slot per row as in the expert cache, and each projection's (S, R, row bytes) view."""
    g = torch.Generator().manual_seed(seed)
    parts = [[get_format(f).quantize(torch.randn(r, k, generator=g)).data.reshape(-1)
              for (f, r, k) in projections] for _ in range(slots)]
    rows = torch.stack([torch.cat(p) for p in parts]).to(device)
    views, offset = [], 0
    for f, r, k in projections:
        fmt = get_format(f)
        n = r * k // fmt.block_size * fmt.block_bytes
        views.append(rows[:, offset:offset + n].view(slots, r, n // r))
        offset += n
    return views


def _nvfp4(x: torch.Tensor) -> tuple[QuantTensor, np.ndarray | None]:
    """``x`` (R, K) as nvfp4: a GGUF file's NVFP4 blocks (returned too) read in where a row is
    whole 64-weight blocks (global scale 1), else ModelOpt's quantiser (a global scale)."""
    if x.shape[-1] % 64:
        return get_format("nvfp4").quantize(x), None
    raw = gguf_quantize("nvfp4", x)
    return gguf_read("nvfp4", raw, tuple(x.shape)), raw.numpy()


def _experts(slots: int, projections: list[tuple[str, int, int]], seed: int,
             device: str = "cpu") -> list[QuantTensor]:
    """As :func:`_pool`, each projection an (S, R, K) QuantTensor; with an nvfp4 projection
    every one is laid out as the expert cache holds it (codes, then each scale, 64-byte
    aligned; a global scale per slot, of its own where it comes from ModelOpt's quantiser)."""
    if all(f != "nvfp4" for f, _, _ in projections):
        return [QuantTensor(f, (slots, r, k), v) for (f, r, k), v in
                zip(projections, _pool(slots, projections, seed, device), strict=True)]
    g = torch.Generator().manual_seed(seed)
    return _slots([[_nvfp4(torch.randn(r, k, generator=g) * (1 + s))[0] if f == "nvfp4"
                    else get_format(f).quantize(torch.randn(r, k, generator=g))
                    for f, r, k in projections] for s in range(slots)], device)


def _slots(experts: list[list[QuantTensor]], device: str) -> list[QuantTensor]:
    """Experts' projections (a list an expert) in one byte row a slot, each projection's
    codes then its scales, 64-byte aligned; each projection as an (S, R, K) QuantTensor."""
    slots = len(experts)
    parts, offset = [], 0
    for qt in experts[0]:
        for key, t in (("data", qt.data), *sorted(qt.scales.items())):
            parts.append((key, t.dtype, t.shape if t.numel() > 1 else (1, 1), offset))
            offset = -(-(offset + t.numel() * t.element_size()) // 64) * 64
    rows = torch.zeros(slots, offset, dtype=torch.uint8)
    for s, one in enumerate(experts):
        pieces = [t for qt in one for _, t in (("data", qt.data), *sorted(qt.scales.items()))]
        for (_, _, _, at), t in zip(parts, pieces, strict=True):
            raw = t.reshape(-1).view(torch.uint8)
            rows[s, at:at + raw.numel()] = raw
    rows = rows.to(device)
    out, i = [], 0
    for qt in experts[0]:
        views = {}
        for _ in range(1 + len(qt.scales)):
            key, dtype, shape, at = parts[i]
            n = torch.Size(shape).numel() * dtype.itemsize
            views[key] = rows[:, at:at + n].view(dtype).view(slots, *shape)
            i += 1
        out.append(QuantTensor(qt.fmt, (slots, *qt.shape), views.pop("data"), views))
    return out


def _gguf_weights(fmt: str, view: torch.Tensor, slot: int) -> np.ndarray:
    raw = view[slot].contiguous().cpu().numpy()
    return dequantize(raw, GGUF_TYPE[fmt]).reshape(view.shape[1], -1).astype(np.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,R,K", [("q8_0", 40, 96), ("q8_0", 17, 288), ("q5_0", 19, 160),
                                     ("q4_k", 21, 512), ("q5_k", 23, 512), ("q6_k", 18, 768),
                                     ("mxfp4", 21, 320)])
@pytest.mark.parametrize("T,A", [(1, 3), (2, 2)])
def test_gemv_matches_gguf_dequantisation(kernels, device, fmt, R, K, T, A):
    """Row counts off the row block (a partial one), block counts off the loop step, several
    tokens and pairs per token, slots read in place from strided rows after another
    projection."""
    _, view = _pool(4, [("q5_0", 3, 32), (fmt, R, K)], seed=R + K, device=device)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(T, K, generator=g)
    index = torch.randint(0, 4, (T * A,), generator=g)
    out = kernels.gather_gemv(fmt, view, index.to(device), x.to(device), A).cpu()
    want = np.stack([_gguf_weights(fmt, view, int(s)) @ x[p // A].double().numpy()
                     for p, s in enumerate(index)])
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("formats", [("q8_0", "q8_0", "q8_0"), ("q4_k", "q4_k", "q6_k"),
                                     ("q5_0", "q5_0", "q8_0"), ("q5_k", "q5_k", "q6_k"),
                                     ("mxfp4", "mxfp4", "mxfp4"), ("nvfp4", "nvfp4", "nvfp4")])
def test_gathered_experts_match_the_slow_twin(kernels, device, dtype, formats):
    """gate/up -> silu -> down, weighted and summed per token, as the dequantise + matmul path
    computes it (mixed formats as in Q4_K_M and Q5_K_M files); pairs whose weight is 0 (masked
    by the slot table) add nothing."""
    H, I_ = 512, 256  # two super-blocks per gate/up row
    qts = _experts(5, [(formats[0], I_, H), (formats[1], I_, H), (formats[2], H, I_)], seed=3,
                   device=device)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, H, generator=g).to(device, dtype)
    w = torch.rand(2, 3, generator=g)
    w[1, 2] = 0.0
    index = torch.tensor([0, 4, 2, 2, 1, 3]).to(device)
    act = torch.nn.functional.silu
    fused = kernels.gathered_fused(x, w.to(device), index, *qts, act)
    slow = kernels.gathered_reference(x, w.to(device), index, *qts, act)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fused.float(), slow.float(), rtol=tol, atol=tol * slow.abs().max())


@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4", "nvfp4"])
def test_the_gpus_launch_choices_compute_the_same(monkeypatch, fmt):
    """The interpreter takes at least INTERPRETER_ROWS rows a program (its time goes by
    programs); the GPU's own choice (one row of gate and one of up a program for q8_0) gives
    the same sums through it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter on the CPU")
    from freetoken.kernels import gather_gemv as kernels

    qts = _experts(3, [(fmt, 32, 64), (fmt, 32, 64), (fmt, 64, 32)], seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 64, generator=g)
    w, index = torch.rand(2, 2, generator=g), torch.tensor([0, 2, 1, 1])
    act = torch.nn.functional.silu
    coarse = kernels.gathered_fused(x, w, index, *qts, act)
    monkeypatch.setattr(gemv_launch, "INTERPRETER_ROWS", 1)
    assert gemv_launch.launch(fmt).rows <= 2
    fine = kernels.gathered_fused(x, w, index, *qts, act)
    torch.testing.assert_close(fine, coarse, rtol=1e-5, atol=1e-5)
    # the reference sums in torch's order, which the CPU's SIMD width sets: on an AVX2 box one
    # nvfp4 sum of 128 came out 1.8e-4 apart (relative), so the bound scales with the output
    slow = kernels.gathered_reference(x, w, index, *qts, act)
    torch.testing.assert_close(fine, slow, rtol=1e-4, atol=1e-3 * float(slow.abs().max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["q8_0", "mxfp4", "nvfp4"])
def test_bit_operations_give_the_same_bits(kernels, monkeypatch, device, dtype, fmt):
    """The ``bits`` launch turns q8_0's int8s or mxfp4's and nvfp4's e2m1 codes (and bf16
    activations) into float32 by bit operations: the same values, so the same sums to the bit,
    masked blocks too."""
    qts = _experts(3, [(fmt, 32, 96), (fmt, 32, 96), (fmt, 96, 32)], seed=9, device=device)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 96, generator=g).to(device, dtype)
    w, index = torch.rand(2, 2, generator=g).to(device), torch.tensor([0, 2, 1, 1]).to(device)
    act = torch.nn.functional.silu
    plain = kernels.gathered_fused(x, w, index, *qts, act)
    monkeypatch.setitem(gemv_launch.KERNELS, fmt,
                        dataclasses.replace(gemv_launch.KERNELS[fmt], bits=True, step=2))
    monkeypatch.setattr(gemv_launch, "INTERPRETER_ROWS", 1)
    by_bits = kernels.gathered_fused(x, w, index, *qts, act)
    monkeypatch.setitem(gemv_launch.KERNELS, fmt,
                        dataclasses.replace(gemv_launch.KERNELS[fmt], bits=False, step=2))
    assert torch.equal(by_bits, kernels.gathered_fused(x, w, index, *qts, act))
    torch.testing.assert_close(by_bits.float(), plain.float(), rtol=1e-4, atol=1e-4)


def test_shapes_that_do_not_fit_are_refused():
    from freetoken.kernels.gather_gemv import gather_gemv
    from freetoken.kernels.gemv_launch import fused

    rows = torch.zeros(2, 3 * 34, dtype=torch.uint8).view(2, 1, 102)
    with pytest.raises(ValueError, match="does not fit 96 inputs"):
        gather_gemv("q8_0", rows, torch.zeros(1, dtype=torch.long), torch.zeros(1, 64), 1)
    with pytest.raises(ValueError, match="rows of 144-byte blocks"):
        gather_gemv("q4_k", rows, torch.zeros(1, dtype=torch.long), torch.zeros(1, 64), 1)
    assert fused(("q4_k", "q4_k", "q6_k")) and not fused(("q4_k", "q4_k", "bf16"))
    assert fused(("nvfp4", "nvfp4", "nvfp4"))
    with pytest.raises(ValueError, match="gather_gemv_scaled"):  # its scales are apart
        gather_gemv("nvfp4", rows, torch.zeros(1, dtype=torch.long), torch.zeros(1, 64), 1)


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("fmt", [*GGUF_TYPE, "q8_0x8"])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_kernels_compile_for_a_gpu(fmt: str, dtype: str, act: int) -> None:
    from freetoken.kernels.gemv_launch import KERNELS

    spec = KERNELS[fmt]
    sig = {"w_ptr": "*u8", "index_ptr": "*i64", "x_ptr": dtype, "out_ptr": dtype, "R": "i32",
           "per": "i32", "slot_stride": "i64", "row_stride": "i32", "x_stride": "i32",
           "out_stride": "i32", "FMT": "constexpr", "NB": "constexpr", "BLOCK_R": "constexpr",
           "STEP": "constexpr", "ACT": "constexpr", "BITS": "constexpr"}
    sig = {**sig, "SUMS": "constexpr", "INT8_X": "constexpr", "ASM": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_gemv", "gather_gemv", sig,
                     {"FMT": fmt, "NB": 2048 // spec.block, "BLOCK_R": spec.rows,
                      "STEP": spec.step, "ACT": act,
                      "BITS": fmt in ("q8_0", "q8_0x8", "mxfp4"), "SUMS": fmt == "q8_0x8",
                      "INT8_X": False, "ASM": True},
                     pdl=dtype == "*bf16")


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("act", [0, 1, 2])
def test_the_scaled_kernel_compiles_for_a_gpu(dtype: str, act: int) -> None:
    from freetoken.kernels.gemv_launch import KERNELS

    spec = KERNELS["nvfp4"]
    sig = {"w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*fp32", "wu_ptr": "*u8", "su_ptr": "*u8",
           "gu_ptr": "*fp32", "index_ptr": "*i64", "x_ptr": dtype, "out_ptr": dtype, "R": "i32",
           "per": "i32", "slot_stride": "i64", "row_stride": "i32", "s_slot_stride": "i64",
           "s_row_stride": "i32", "g_slot_stride": "i64", "x_stride": "i32",
           "out_stride": "i32", "FMT": "constexpr", "NB": "constexpr", "BLOCK_R": "constexpr",
           "STEP": "constexpr", "ACT": "constexpr", "BITS": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_gemv", "gather_gemv_scaled", sig,
                     {"FMT": "nvfp4", "NB": 2816 // spec.block, "BLOCK_R": spec.rows,
                      "STEP": spec.step, "ACT": act, "BITS": spec.bits},
                     pdl=dtype == "*bf16")


def test_gate_and_up_run_as_one_stack_where_their_rows_follow():
    """An expert row holds up's blocks right after gate's: the two are one launch over 2I
    rows, with the bits of two launches."""
    from freetoken.kernels.gather_gemv import stacked

    gate, up, _ = _pool(3, [("q8_0", 8, 64), ("q8_0", 8, 64), ("q8_0", 64, 32)], seed=1)
    both = stacked(QuantTensor("q8_0", (3, 8, 64), gate), QuantTensor("q8_0", (3, 8, 64), up))
    assert both is not None and torch.equal(both[:, :8], gate) and torch.equal(both[:, 8:], up)
    assert stacked(QuantTensor("q8_0", (3, 8, 64), up),
                   QuantTensor("q8_0", (3, 8, 64), gate)) is None  # up does not follow
    assert stacked(QuantTensor("q8_0", (3, 8, 64), gate),
                   QuantTensor("q5_0", (3, 8, 64), up)) is None
    gate, up, _ = _experts(3, [("nvfp4", 8, 64), ("nvfp4", 8, 64), ("nvfp4", 64, 64)], seed=1)
    assert stacked(gate, up) is None  # the codes alone: their scales are apart


@pytest.mark.parametrize("device", DEVICES)
def test_one_stack_has_the_bits_of_two_launches(kernels, device):
    gate, up, down = _pool(4, [("q8_0", 32, 96), ("q8_0", 32, 96), ("q8_0", 96, 32)], seed=2,
                           device=device)
    qts = [QuantTensor("q8_0", (4, r, k), v) for v, (r, k) in
           zip((gate, up, down), ((32, 96), (32, 96), (96, 32)), strict=True)]
    x = torch.randn(2, 96, device=device)
    index = torch.tensor([0, 3, 2, 1], device=device)
    both = kernels.stacked(qts[0], qts[1])
    one = kernels.gather_gemv("q8_0", both, index, x, 2)
    two = torch.cat([kernels.gather_gemv("q8_0", q.data, index, x, 2) for q in qts[:2]], 1)
    assert torch.equal(one, two)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("fmt,K", [("q8_0", 96), ("q5_0", 96), ("q4_k", 256), ("q5_k", 256),
                                   ("q6_k", 256), ("nvfp4", 128), ("nvfp4", 96)])
def test_the_stack_applies_the_activation_in_its_launch(kernels, device, act, fmt, K):
    """gate, up and act(g) * u in one launch where the activation has a code (gelu without
    the tanh has none: torch applies it), close to the two sums rounded then combined. nvfp4's
    up is not after gate's codes (its scales are between): its launch reads it where it is
    (K 128: GGUF blocks, global scale 1; K 96: ModelOpt's, gate's and up's own)."""
    from freetoken.kernels.activation import ACTIVATIONS, glu
    from freetoken.kernels.expert_matmul import weigh_pairs

    qts = _experts(4, [(fmt, 32, K), (fmt, 32, K), ("q8_0", K, 32)], seed=3, device=device)
    down = qts[2].data
    assert (kernels.stacked(*qts[:2]) is not None) == (fmt != "nvfp4")
    assert kernels.paired(*qts[:2]) == (fmt == "nvfp4")
    x = torch.randn(2, K, device=device)
    w = torch.rand(2, 2, device=device)
    index = torch.tensor([0, 3, 2, 1], device=device)
    fn = ACTIVATIONS[act]
    assert kernels.glu_code(fn) == {"silu": 1, "gelu_pytorch_tanh": 2, "gelu": 0}[act]
    got = kernels.gathered_fused(x, w, index, *qts, fn)
    g, u = (kernels.gemv(q, index, x, 2) for q in qts[:2])
    want = weigh_pairs(kernels.gather_gemv("q8_0", down, index, glu(fn, g, u), 1), w)
    # compiled, the kernel's exp is the GPU's fast one: a few float32 ulps of the activation
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_launch_choices_can_be_set_from_the_environment(monkeypatch):
    from freetoken.errors import ConfigError

    monkeypatch.setattr(gemv_launch, "_launch_overrides", gemv_launch._launch_overrides.__wrapped__)
    assert gemv_launch.launch("q8_0") == gemv_launch.KERNELS["q8_0"]
    monkeypatch.setenv("FREETOKEN_GEMV_LAUNCH", "q8_0=4,16,1,1 mxfp4=2,8,4")
    assert (gemv_launch.launch("q8_0").rows, gemv_launch.launch("q8_0").step,
            gemv_launch.launch("q8_0").warps, gemv_launch.launch("q8_0").bits) == (4, 16, 1, True)
    assert gemv_launch.launch("mxfp4").warps == 4
    assert gemv_launch.launch("q4_k") == gemv_launch.KERNELS["q4_k"]
    monkeypatch.setenv("FREETOKEN_GEMV_LAUNCH", "q8_0x8=2,8,1,0,1")
    assert gemv_launch.launch("q8_0x8").sums and not gemv_launch.launch("q8_0x8").bits
    monkeypatch.setenv("FREETOKEN_GEMV_LAUNCH", "q8_0x8=8,16,2,0,0,1")
    spec = gemv_launch.launch("q8_0x8")
    assert spec.int8_x and not spec.sums and (spec.rows, spec.step, spec.warps) == (8, 16, 2)
    for bad in ("q8_0=4,16", "q9_9=4,16,1", "q8_0=0,16,1", "q8_0=a,b,c", "q8_0=4,16,1,2",
                "q8_0=4,16,1,1,1", "q8_0x8=2,8,1,0,2", "q8_0x8=2,8,1,0,1,1",
                "q8_0=4,16,1,0,0,1", "q8_0x8=2,8,1,0,0,1,1"):
        monkeypatch.setenv("FREETOKEN_GEMV_LAUNCH", bad)
        with pytest.raises(ConfigError, match="FREETOKEN_GEMV_LAUNCH entry"):
            gemv_launch.launch("q8_0")
        with pytest.raises(ConfigError, match="FREETOKEN_GEMV_LAUNCH entry"):
            gemv_launch.fused(("q8_0", "q8_0", "q8_0"))  # what a layer asks when it is built


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,K", [(40, 512), (17, 768)])
@pytest.mark.parametrize("sums", [False, True])
def test_regrouped_q8_0_matches_gguf_dequantisation(kernels, device, dtype, R, K, sums,
                                                    monkeypatch):
    """Q8_0 regrouped as Q8_0x8 (resident's blocks on a GPU): the kernel on the regrouped bytes
    against the gguf package's dequantisation of the file's Q8_0 bytes, and against the Q8_0
    kernel on those bytes; so with each block's products summed before its scale (``sums``,
    a launch choice of Q8_0x8 alone)."""
    from freetoken.quant.q8_0x8 import regroup

    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8",
                        dataclasses.replace(gemv_launch.KERNELS["q8_0x8"], sums=sums, int8_x=False))

    _, view = _pool(4, [("q5_0", 3, 32), ("q8_0", R, K)], seed=R + K, device=device)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, K, generator=g).to(dtype)
    index = torch.randint(0, 4, (6,), generator=g)
    out = kernels.gather_gemv("q8_0x8", regroup(view), index.to(device), x.to(device), 3)
    want = np.stack([_gguf_weights("q8_0", view, int(s)) @ x[p // 3].double().numpy()
                     for p, s in enumerate(index)])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(out.cpu().double().numpy(), want, rtol=tol, atol=tol * 10)
    q8 = kernels.gather_gemv("q8_0", view, index.to(device), x.to(device), 3)
    torch.testing.assert_close(out, q8, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,K", [(40, 512), (17, 768)])
@pytest.mark.parametrize("act", [0, 1])
def test_int8_x_reader_matches_gguf_dequantisation_of_its_int8_x(kernels, device, dtype, R, K,
                                                                  act, monkeypatch):
    """Q8_0x8 with x quantised to int8 blocks in the kernel (``int8_x``): against the gguf
    package's dequantisation of the file's Q8_0 bytes times x as :func:`int8_x_reference`
    quantises it (the integer dots are exact: only the float sums' order differs; compiled,
    a quotient's last bit may move one of x's values by a step), and near the float reader's
    result; gate and up as one stack with the activation."""
    from freetoken.kernels.activation import ACTIVATIONS, glu
    from freetoken.quant.q8_0x8 import regroup

    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8",
                        dataclasses.replace(gemv_launch.KERNELS["q8_0x8"], int8_x=True))
    _, view = _pool(4, [("q5_0", 3, 32), ("q8_0", 2 * R, K)], seed=R + K, device=device)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, K, generator=g).to(dtype)
    x[1, 32:64] = 0  # a block of zeros: scale 0, values 0
    index = torch.randint(0, 4, (6,), generator=g)
    rows = regroup(view)[:, :R] if act else regroup(view)  # with act, up's rows follow gate's
    out = kernels.gather_gemv("q8_0x8", rows, index.to(device), x.to(device), 3,
                              act=act).cpu().double()
    q, d = kernels.int8_x_reference(x)
    assert q.dtype == torch.int8 and d.shape == (2, K // 32) and q[1, 32:64].eq(0).all()
    xq = (q.double().unflatten(-1, (-1, 32)) * d.double()[..., None]).flatten(-2).numpy()
    full = np.stack([_gguf_weights("q8_0", view, int(s)) @ xq[p // 3]
                     for p, s in enumerate(index)])
    exact = torch.from_numpy(full)
    if act:
        exact = glu(ACTIVATIONS["silu"], exact[:, :R], exact[:, R:])
    if device == "cpu" and dtype == torch.float32:
        torch.testing.assert_close(out, exact, rtol=1e-4, atol=1e-4)
    else:  # bf16's rounding of the result; compiled, a value of x a step off (the quotient)
        torch.testing.assert_close(out, exact, rtol=2e-2, atol=1e-2 * exact.abs().max().item())
    monkeypatch.setitem(gemv_launch.KERNELS, "q8_0x8",
                        dataclasses.replace(gemv_launch.KERNELS["q8_0x8"], int8_x=False))
    floats = kernels.gather_gemv("q8_0x8", rows, index.to(device), x.to(device), 3,
                                 act=act).cpu().double()
    # x's rounding (each value within 1/254 of its block's largest): about 1 % of the whole
    assert (out - floats).norm() < 0.03 * floats.norm()


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("act", [0, 1])
def test_the_int8_x_reader_compiles_for_a_gpu(dtype: str, act: int) -> None:
    """The int8_x reader with the GPU's dp4a instruction (inline PTX, so ptxas checks it)."""
    sig = {"w_ptr": "*u8", "index_ptr": "*i64", "x_ptr": dtype, "out_ptr": dtype, "R": "i32",
           "per": "i32", "slot_stride": "i64", "row_stride": "i32", "x_stride": "i32",
           "out_stride": "i32", "FMT": "constexpr", "NB": "constexpr", "BLOCK_R": "constexpr",
           "STEP": "constexpr", "ACT": "constexpr", "BITS": "constexpr", "SUMS": "constexpr",
           "INT8_X": "constexpr", "ASM": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_gemv", "gather_gemv", sig,
                     {"FMT": "q8_0x8", "NB": 2048 // 256, "BLOCK_R": 8, "STEP": 16, "ACT": act,
                      "BITS": True, "SUMS": False, "INT8_X": True, "ASM": True},
                     pdl=dtype == "*bf16")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R,K", [(21, 320), (9, 1024)])
@pytest.mark.parametrize("T,A", [(1, 3), (2, 2)])
def test_nvfp4_gemv_matches_gguf_dequantisation(kernels, device, R, K, T, A):
    """A GGUF file's NVFP4 blocks read into nvfp4, in cache slots after another projection,
    against the gguf package's dequantisation of those blocks: rows off the row block, blocks
    off the loop step (320: 20 blocks of 16)."""
    g = torch.Generator().manual_seed(R + K)
    blocks = [gguf_quantize("nvfp4", torch.randn(R, K, generator=g)) for _ in range(4)]
    _, qt = _slots([[get_format("q5_0").quantize(torch.randn(3, 32, generator=g)),
                     gguf_read("nvfp4", b, (R, K))] for b in blocks], device)
    x = torch.randn(T, K, generator=g)
    index = torch.randint(0, 4, (T * A,), generator=g)
    out = kernels.gather_gemv_scaled(qt, index.to(device), x.to(device), A).cpu()
    want = np.stack([dequantize(blocks[int(s)].numpy(), GGMLQuantizationType.NVFP4)
                     .reshape(R, K).astype(np.float64) @ x[p // A].double().numpy()
                     for p, s in enumerate(index)])
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True])
def test_nvfp4_reads_every_scale_byte_and_the_global_scale(kernels, device, shared):
    """Each of the 254 e4m3 scale bytes (NaN's two left out: no quantiser writes them) alone
    on a row of one block, subnormals and negatives too, times a global scale one per slot
    or one for all: the kernel's sums against the format's dequantiser in float64. Codes
    and x positive, so no sum cancels and each row is checked to its own magnitude."""
    scale = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(1, 8, (2, 254, 16), generator=g, dtype=torch.uint8)
    data = codes[..., 0::2] | (codes[..., 1::2] << 4)
    ws2 = torch.tensor(0.375) if shared else torch.tensor([[[3.0]], [[0.0078125]]])
    qt = QuantTensor("nvfp4", (2, 254, 16), data.to(device), {
        "weight_scale": scale.expand(2, 254).reshape(2, 254, 1).view(torch.float8_e4m3fn)
        .to(device), "weight_scale_2": ws2.to(device)})
    x = torch.rand(1, 16, generator=g) + 0.5
    index = torch.tensor([1, 0])
    out = kernels.gather_gemv_scaled(qt, index.to(device), x.to(device), 2).cpu()
    ref = QuantTensor("nvfp4", (2, 254, 16), data, {
        "weight_scale": qt.scales["weight_scale"].cpu(),
        "weight_scale_2": ws2 if shared else ws2.reshape(2, 1, 1)})
    dense = get_format("nvfp4").dequantize(ref).double() if shared else torch.stack(
        [get_format("nvfp4").dequantize(QuantTensor("nvfp4", (254, 16), data[e], {
            "weight_scale": ref.scales["weight_scale"][e],
            "weight_scale_2": ws2[e].reshape(())})).double() for e in range(2)])
    want = dense[index] @ x[0].double()
    assert want.count_nonzero() == 2 * 252 and (want < 0).any()  # scale bytes 0, 0x80: 0
    np.testing.assert_allclose(out.double().numpy(), want.numpy(), rtol=2e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_experts_from_the_engines_own_bank(kernels, device):
    """nvfp4 experts laid out by the engine's own :class:`BankBuilder` (the rows of the host
    bank, the expert cache's slots and resident blocks; gate and up GGUF blocks, down from
    ModelOpt's quantiser with a global scale of its own) read by the fused kernels through
    ``layout.quant``: the dequantise + matmul twin's result."""
    E, H, I_ = 4, 128, 48
    g = torch.Generator().manual_seed(11)
    builder = BankBuilder(0, E, H, I_)
    for e in range(E):
        for proj in PROJECTIONS:
            builder.add(proj, _nvfp4(torch.randn(*builder.want(proj), generator=g))[0], e)
    bank = builder.build(pinned=False, device=torch.device(device))
    views = [bank.layout.quant(bank.rows, p) for p in PROJECTIONS]
    assert "weight_scale_2" in views[2].scales
    x = torch.randn(2, H, generator=g).to(device)
    w = torch.rand(2, 3, generator=g).to(device)
    index = torch.tensor([3, 0, 2, 1, 1, 3]).to(device)
    act = torch.nn.functional.silu
    fused = kernels.gathered_fused(x, w, index, *views, act)
    slow = kernels.gathered_reference(x, w, index, *views, act)
    torch.testing.assert_close(fused, slow, rtol=1e-4, atol=1e-4 * slow.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,T,A", [("q8_0", 2, 3), ("q8_0", 1, 8), ("mxfp4", 2, 3)])
def test_a_slot_table_reads_slots_and_drops_the_pairs_it_lacks(kernels, device, fmt, T, A):
    """``table``: pair p reads slot table[index[p]], and a pair whose entry is -1 adds nothing:
    the bits of the slots passed in directly with those pairs' weights 0."""
    H, I_ = 256, 64
    qts = _experts(6, [(fmt, I_, H), (fmt, I_, H), (fmt, H, I_)], seed=5, device=device)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g).to(device)
    w = torch.rand(T, A, generator=g).to(device)
    ids = torch.randint(0, 9, (T * A,), generator=g).to(device)
    table = torch.tensor([3, -1, 0, 4, 1, -1, 5, 2, -1]).to(device)
    act = torch.nn.functional.silu
    got = kernels.gathered_fused(x, w, ids, *qts, act, None, table)
    slot = table[ids]
    zeroed = torch.where((slot < 0).view(T, A), 0.0, w)
    assert torch.equal(got, kernels.gathered_fused(x, zeroed, slot.clamp(min=0), *qts, act))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,A,H", [(1, 8, 2048), (3, 2, 96)])
def test_the_weighted_sum_is_one_launch_with_torchs_roundings(kernels, device, dtype, T, A, H):
    """``weighed`` against ``weigh_pairs`` (torch's multiply and sum, the same roundings; the
    float32 sums may run in another order); pairs whose slot is negative count 0, as the
    old path's zeroed weights."""
    from freetoken.kernels.expert_matmul import weigh_pairs

    g = torch.Generator().manual_seed(7)
    y = (torch.randn(T * A, H, generator=g) * 4).to(device, dtype)
    w = torch.rand(T, A, generator=g).to(device, dtype)
    slot = torch.randint(-1, 3, (T * A,), generator=g).to(device)
    for s, ww in ((None, w), (slot, torch.where((slot >= 0).view(T, A), w, 0.0))):
        got, want = kernels.weighed(y, w, s), weigh_pairs(y, ww)
        assert got.shape == want.shape and got.dtype == want.dtype
        if dtype is torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
        elif device == "cuda":  # a float32 sum in another order: a bf16 step apart at most
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)
        else:  # the interpreter rounds to bf16 its own way
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                                       atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
@pytest.mark.parametrize("mask", [False, True])
def test_the_weighted_sum_compiles_for_a_gpu(dtype: str, mask: bool) -> None:
    sig = {"y_ptr": dtype, "w_ptr": dtype, "slot_ptr": "*i64", "out_ptr": dtype, "H": "i32",
           "y_stride": "i64", "out_stride": "i64", "A": "constexpr", "BLOCK": "constexpr",
           "MASK": "constexpr"}
    compile_for_sm90("freetoken.kernels.triton_gemv", "weigh_sum", sig,
                     {"A": 8, "BLOCK": 1024, "MASK": mask},
                     pdl=dtype == "*bf16")
