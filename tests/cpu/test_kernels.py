"""CPU expert kernels: every format x ISA tier x batch size against the quant modules' torch
reference, and every tier against the scalar reference kernel."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.kernels.activation import ACTIVATIONS
from freetoken.quant import QuantTensor, get_format

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

E, A = 8, 4
# (hidden, intermediate) per format: whole blocks, with SIMD and chunk tails where allowed.
SHAPES = {
    "bf16": (80, 40),
    "q8_0": (96, 160),
    "q4_0": (96, 160),
    "q5_0": (96, 160),
    "mxfp4": (96, 160),
    "q4_k": (256, 512),
    "q5_k": (256, 512),
    "q6_k": (256, 512),
    "nvfp4": (96, 160),  # int8 activations from AVX2 and VNNI; float on the AVX-512 tier
    "fp8_block": (200, 136),
    "f32": (83, 41),  # odd: the 16/8-wide loops' masked and scalar tails
}
# Largest error, relative to the output's largest magnitude, per activation kind.
TOLERANCE = {"f32": 2e-5, "bf16": 2e-2, "q8": 3e-2}
BATCHES = [1, 2, 4, 5, 16]
TIERS = [t for t in cx.ISAS if cx.available() is None and cx.ISAS.index(t) <= cx.ISAS.index(
    cx.best_isa())]


@dataclass
class Bank:
    fmt: str
    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dequantised, float64


def make_bank(fmt: str, hidden: int, inter: int, seed: int = 0) -> Bank:
    g = torch.Generator().manual_seed(seed)
    q = get_format(fmt)

    def one(rows: int, cols: int) -> QuantTensor:
        w = torch.randn(E, rows, cols, generator=g) / cols**0.5
        return q.quantize(w)

    gate, up, down = one(inter, hidden), one(inter, hidden), one(hidden, inter)
    dense = tuple(q.dequantize(t).double() for t in (gate, up, down))
    return Bank(fmt, gate, up, down, dense)  # type: ignore[arg-type]


def reference(bank: Bank, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
              act: str = "silu") -> torch.Tensor:
    """The torch reference: dequantised weights, float64, one (token, expert) pair at a time."""
    fn = ACTIVATIONS[act]
    gate, up, down = bank.dense
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            if e < 0:
                continue
            h = x[t].double()
            out[t] += float(w[t, a]) * (down[e] @ (fn(gate[e] @ h) * (up[e] @ h)))
    return out


def stacks(bank: Bank) -> tuple[cx.ExpertStack, ...]:
    return tuple(cx.ExpertStack.from_quant(t) for t in (bank.gate, bank.up, bank.down))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


_EXECUTORS: dict[tuple[str, str], cx.CpuMoeExecutor] = {}
_BANKS: dict[str, Bank] = {}


def executor(tier: str, act: str = "auto") -> cx.CpuMoeExecutor:
    """One executor per (tier, act mode) with a layer per format (layer = format index)."""
    key = (tier, act)
    if key not in _EXECUTORS:
        ex = cx.CpuMoeExecutor(threads=1, isa=tier, act=act)
        for i, fmt in enumerate(cx.FORMATS):
            try:
                ex.add_layer(i, *stacks(bank(fmt)))
            except ValueError:
                if act == "auto":
                    raise
        _EXECUTORS[key] = ex
    return _EXECUTORS[key]


def bank(fmt: str) -> Bank:
    if fmt not in _BANKS:
        _BANKS[fmt] = make_bank(fmt, *SHAPES[fmt])
    return _BANKS[fmt]


def inputs(fmt: str, T: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, SHAPES[fmt][0], generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    w = torch.softmax(torch.randn(T, A, generator=g), -1)
    return x, ids, w


@pytest.mark.parametrize("T", BATCHES)
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", cx.FORMATS)
def test_matches_torch_reference(fmt: str, tier: str, T: int) -> None:
    ex = executor(tier)
    layer = cx.FORMATS.index(fmt)
    x, ids, w = inputs(fmt, T, seed=T)
    got = ex.run(x, ids, w, layer)
    kinds = {act for _, act in ex.layers[layer].kernels}
    tol = max(TOLERANCE[k] for k in kinds)
    assert rel_err(got, reference(bank(fmt), x, ids, w)) < tol, ex.layers[layer].kernels


@pytest.mark.parametrize("tier", [t for t in TIERS if t != "scalar"])
@pytest.mark.parametrize("fmt", cx.FORMATS)
def test_tier_matches_scalar_twin(fmt: str, tier: str) -> None:
    """The tier's kernels against the scalar kernels reading the same activation kind."""
    layer = cx.FORMATS.index(fmt)
    fast = executor(tier)
    kinds = {act for _, act in fast.layers[layer].kernels}
    for act in kinds:
        if act == "bf16":
            continue  # bf16 activations only with bf16 weights, checked below
        slow = executor("scalar", act if act != "f32" else "auto")
        ref = executor(tier, act)
        x, ids, w = inputs(fmt, 16, seed=7)
        got, want = ref.run(x, ids, w, layer), slow.run(x, ids, w, layer)
        # int8 h may round a step apart when gate/up sum in another order
        tol = 1e-5 if act == "f32" else 5e-4
        assert rel_err(got, want.double()) < tol, (fmt, tier, act, ref.layers[layer].kernels)


def test_bf16_activations_match_scalar_twin() -> None:
    if "avx512_bf16" not in TIERS or cx.kernel_isa("bf16", "bf16", "avx512_bf16") != "avx512_bf16":
        pytest.skip("no AVX512-BF16 on this CPU")
    layer = cx.FORMATS.index("bf16")
    fast = executor("avx512_bf16")
    assert fast.layers[layer].kernels[0] == ("avx512_bf16", "bf16")
    slow = cx.CpuMoeExecutor(threads=1, isa="scalar")
    slow.add_layer(0, *stacks(bank("bf16")))
    # the scalar executor picks f32 activations; compare both to the reference instead
    x, ids, w = inputs("bf16", 16, seed=3)
    want = reference(bank("bf16"), x, ids, w)
    assert rel_err(fast.run(x, ids, w, layer), want) < TOLERANCE["bf16"]
    assert rel_err(slow.run(x, ids, w, 0), want) < TOLERANCE["f32"]


@pytest.mark.parametrize("tier", TIERS)
def test_f32_weights_read_f32_activations_in_every_mode(tier: str) -> None:
    """f32 weights keep float activations even where the executor quantises x for the others,
    on the widest float kernel at or below the tier."""
    layer = cx.FORMATS.index("f32")
    want = cx.ISAS[min(cx.ISAS.index(tier), cx.ISAS.index("avx512"))]
    for act in ("auto", "f32", "q8"):
        assert executor(tier, act).layers[layer].kernels == ((want, "f32"),) * 3, act


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q5_k"])
def test_int8_activation_error_bound(fmt: str) -> None:
    """Int8 blocks for x and for h cost under 2 % RMS against float activations.

    One rounding to a block step of amax/127 is ~0.5 % RMS of a Gaussian block; two of them
    (x before gate/up, h before down) and h's heavier tails give ~1.2 %.
    """
    x, ids, w = inputs(fmt, 16, seed=11)
    want = reference(bank(fmt), x, ids, w)
    got = executor("scalar", "q8").run(x, ids, w, cx.FORMATS.index(fmt)).double()
    rms = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
    assert rms < 2e-2


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
def test_activations(act: str) -> None:
    b = bank("q8_0")
    ex = cx.CpuMoeExecutor(threads=1, act="f32")
    ex.add_layer(0, *stacks(b), activation=act)
    x, ids, w = inputs("q8_0", 4)
    assert rel_err(ex.run(x, ids, w, 0), reference(b, x, ids, w, act)) < TOLERANCE["f32"]


def test_skipped_pairs_and_repeated_experts() -> None:
    """ids < 0 are left out; an expert chosen by every token is summed once per token."""
    b = bank("bf16")
    ex = executor(TIERS[-1])
    layer = cx.FORMATS.index("bf16")
    x, ids, w = inputs("bf16", 6)
    ids[:, 0] = 3
    ids[::2, 1] = -1
    ids[5] = -1
    got = ex.run(x, ids, w, layer)
    assert torch.equal(got[5], torch.zeros_like(got[5]))
    assert rel_err(got, reference(b, x, ids, w)) < TOLERANCE["bf16"]


@pytest.mark.parametrize("split", ["auto", "rows", "experts"])
def test_no_routed_pair_gives_zeros(split: str) -> None:
    """Every id < 0: the output is zeros, also in a caller's buffer that held other data."""
    ex = cx.CpuMoeExecutor(threads=2)
    ex.add_layer(0, *stacks(bank("q8_0")))
    ex.set_down_split(split)
    x, ids, w = inputs("q8_0", 3)
    ids[:] = -1
    out = torch.full((3, SHAPES["q8_0"][0]), float("nan"))
    ex.submit(x, ids, w, 0, out=out).wait()
    assert torch.equal(out, torch.zeros_like(out))
    ex.close()


def test_per_expert_tensors_equal_stacked() -> None:
    b = bank("q4_k")
    per = [cx.ExpertStack.from_quant([QuantTensor(t.fmt, t.shape[1:], t.data[e])
                                      for e in range(E)]) for t in (b.gate, b.up, b.down)]
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *per)
    ex.add_layer(1, *stacks(b))
    x, ids, w = inputs("q4_k", 3)
    assert torch.equal(ex.run(x, ids, w, 0), ex.run(x, ids, w, 1))


def test_thread_count_does_not_change_the_result() -> None:
    b = bank("q8_0")
    one = cx.CpuMoeExecutor(threads=1)
    three = cx.CpuMoeExecutor(threads=3)
    for ex in (one, three):
        ex.add_layer(0, *stacks(b))
    x, ids, w = inputs("q8_0", 16)
    assert torch.equal(one.run(x, ids, w, 0), three.run(x, ids, w, 0))


@pytest.mark.parametrize("fmt", cx.FORMATS)
def test_weight_bytes_count_each_expert_once(fmt: str) -> None:
    b = bank(fmt)
    ex = executor("scalar")
    x, ids, w = inputs(fmt, 16)
    fut = ex.submit(x, ids, w, cx.FORMATS.index(fmt))
    fut.wait()
    stored = sum(t.data[0].numel() * t.data.element_size()
                 + sum(s[0].numel() * s.element_size() for s in t.scales.values() if s.dim())
                 for t in (b.gate, b.up, b.down))
    assert cx.expert_bytes(fmt, *SHAPES[fmt]) == stored
    assert fut.weight_bytes == len(ids.unique()) * stored


def test_bad_shapes_say_what_is_wrong() -> None:
    b = bank("q8_0")
    gate, up, down = stacks(b)
    ex = cx.CpuMoeExecutor(threads=1)
    with pytest.raises(ValueError, match="down_proj: shape"):
        ex.add_layer(0, gate, up, gate)
    ex.add_layer(0, gate, up, down)
    x, ids, w = inputs("q8_0", 2)
    ids[0, 0] = E
    with pytest.raises(ValueError, match="expert ids must be < 8"):
        ex.submit(x, ids, w, 0)


@pytest.mark.parametrize("tier", TIERS)
def test_int8_activations_round_like_torch(tier: str) -> None:
    """Every quantiser tier against torch: scale amax / 127, round half to even, clamp."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=g) * 3
    x[64:96] = 0.0  # an all-zero block
    x[100] = -0.0
    x[200:232] = torch.arange(-16, 16) * 0.5  # exact halves after scaling
    q, d, gs, _ = cx.quantize_q8(x, tier)
    blocks = x.view(-1, 32)
    amax = blocks.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    want = torch.round(blocks * inv).clamp(-127, 127).to(torch.int8).view(-1)
    assert torch.equal(q, want)
    assert torch.equal(d, (amax / 127.0).view(-1))
    assert torch.equal(gs, want.view(-1, 4).sum(1, dtype=torch.int32))


@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_k", "q5_k"])
def test_down_splits_give_the_same_bits(fmt: str, T: int) -> None:
    """Down split per expert (decode) and per chunk of H rows (prefill) sum the same pairs in
    the same order: equal bits, at any thread count and gate/up item size; auto picks by the
    number of pairs."""
    b = bank(fmt)
    x, ids, w = inputs(fmt, T, seed=11)
    ids[0, 1] = -1  # a pair computed elsewhere
    outs = []
    for threads in (1, 3):
        ex = cx.CpuMoeExecutor(threads=threads)
        ex.add_layer(0, *stacks(b))
        for split, rows1 in (("rows", 0), ("experts", 0), ("auto", 0), ("experts", 128)):
            ex.set_down_split(split)
            ex.set_gate_up_rows(rows1)
            outs.append(ex.run(x, ids, w, 0))
        ex.close()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert rel_err(outs[0], reference(b, x, ids, w)) < TOLERANCE["q8"]


def test_bad_tuning_values_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="auto, rows, experts"):
        executor("scalar").set_down_split("columns")
    for rows in (48, 256, -32):
        with pytest.raises(ValueError, match="multiple of 32 up to 128"):
            executor("scalar").set_gate_up_rows(rows)


@pytest.mark.parametrize("split", ["rows", "experts"])
def test_job_timing_accounts_for_the_call(split: str) -> None:
    """The timing record of a job: phases end in order, the last at the job's own time, and the
    busy time of the workers fits in (workers + the waiting thread) x the job's time."""
    ex = cx.CpuMoeExecutor(threads=2)
    ex.add_layer(0, *stacks(bank("q8_0")))
    ex.set_down_split(split)
    ex.set_timing(True)
    x, ids, w = inputs("q8_0", 4)
    fut = ex.submit(x, ids, w, 0)
    fut.wait()
    t = fut.timing
    assert t is not None and 0 <= t.start <= fut.seconds
    ends = [e for e in t.ends if e]
    phases = 3  # x, gate/up, down (with experts split, down's last item per rows sums them)
    assert len(ends) == phases and max(ends) == pytest.approx(fut.seconds, abs=1e-9)
    assert ends[0] <= ends[1] and ends[-1] == max(ends)
    assert all(b > 0 for b in t.busy[:phases]) and t.busy[phases:] == (0.0,) * (4 - phases)
    assert sum(t.busy) <= (ex.threads + 1) * fut.seconds
    assert 0 <= t.await_s <= t.busy[2]
    ex.set_timing(False)
    fut = ex.submit(x, ids, w, 0)
    fut.wait()
    assert fut.timing is None
    ex.close()


def test_a_caller_that_only_waits_gets_the_same_result() -> None:
    """wait() without joining the job's items: the workers alone do it, to the same bits."""
    b = bank("q8_0")
    x, ids, w = inputs("q8_0", 4, seed=2)
    ex = cx.CpuMoeExecutor(threads=1)
    ex.add_layer(0, *stacks(b))
    joined = ex.run(x, ids, w, 0)
    ex.set_join(False)
    assert torch.equal(ex.run(x, ids, w, 0), joined)
    g = b.gate  # (E, I, H): its first expert as a dense matrix
    lid = ex.add_linear(cx.ExpertStack.from_quant(QuantTensor(g.fmt, (1, *g.shape[1:]),
                                                              g.data[:1])))
    alone = ex.submit_linear(x, lid).wait()
    ex.set_join(True)
    assert torch.equal(ex.submit_linear(x, lid).wait(), alone)
    ex.close()


@pytest.mark.parametrize("split", ["rows", "experts"])
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "mxfp4"])
def test_biased_experts_with_the_clamped_swiglu(fmt: str, tier: str, split: str) -> None:
    """GPT-OSS's experts: gate/up biases before the clamp (a limit low enough to cut most
    outputs), down's bias before the routing weight; either down split."""
    from freetoken.kernels.activation import ClampedSwiGLU

    b = bank(fmt)
    I_, H = b.gate.shape[1], b.gate.shape[2]
    g = torch.Generator().manual_seed(5)
    bias = (torch.randn(E, I_, generator=g), torch.randn(E, I_, generator=g),
            torch.randn(E, H, generator=g))
    glu = ClampedSwiGLU(1.702, 0.5)
    ex = cx.CpuMoeExecutor(threads=1, isa=tier)
    ex.add_layer(0, *stacks(b), activation="swiglu_oai", swiglu=(glu.alpha, glu.limit),
                 bias=bias)
    ex.set_down_split(split)
    x, ids, w = inputs(fmt, 5, seed=3)
    gate, up, down = b.dense
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e, h = int(ids[t, a]), x[t].double()
            gu = glu.glu(gate[e] @ h + bias[0][e].double(), up[e] @ h + bias[1][e].double())
            want[t] += float(w[t, a]) * (down[e] @ gu + bias[2][e].double())
    pre = torch.einsum("eih,th->tei", gate, x.double()) + bias[0].double()
    assert (pre > glu.limit).double().mean() > 0.25  # the clamp bites
    kinds = {act for _, act in ex.layers[0].kernels}
    assert rel_err(ex.run(x, ids, w, 0), want) < max(TOLERANCE[k] for k in kinds)


def test_swiglu_and_biases_are_checked() -> None:
    b = bank("bf16")
    ex = cx.CpuMoeExecutor(threads=1)
    with pytest.raises(ValueError, match="swiglu .* goes with activation swiglu_oai"):
        ex.add_layer(0, *stacks(b), activation="silu", swiglu=(1.702, 7.0))
    with pytest.raises(ValueError, match="positive alpha and limit"):
        ex.add_layer(0, *stacks(b), activation="swiglu_oai", swiglu=(1.702, 0.0))
    I_ = b.gate.shape[1]
    with pytest.raises(ValueError, match=r"expert biases of shapes .* want"):
        ex.add_layer(0, *stacks(b), bias=(torch.zeros(E, I_), torch.zeros(E, I_),
                                          torch.zeros(E, I_)))
