"""Dense matrices on the CPU pool: every format x ISA tier x batch against the quant modules'
torch reference, and a model whose dense layers run there against the resident model."""

from __future__ import annotations

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.layers.pool_linear import PoolLinear
from freetoken.quant import QuantTensor, get_format
from tests.cpu.test_kernels import SHAPES, TIERS, TOLERANCE

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


def _one(qt: QuantTensor) -> cx.ExpertStack:
    return cx.ExpertStack.from_quant(QuantTensor(
        qt.fmt, (1, *qt.shape), qt.data.unsqueeze(0),
        {k: v.reshape(1, *v.shape) for k, v in qt.scales.items()}))


@pytest.fixture(scope="module")
def pool():
    ex = cx.CpuMoeExecutor(threads=2)
    yield ex
    ex.close()


@pytest.fixture(scope="module", params=TIERS)
def executor(request):
    ex = cx.CpuMoeExecutor(threads=2, isa=request.param)
    yield ex
    ex.close()


@pytest.mark.parametrize("fmt", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 2, 4, 16, 17])
def test_dense_matrix_matches_reference(executor, fmt, tokens):
    cols, rows = SHAPES[fmt]  # odd row counts leave a short last chunk
    torch.manual_seed(tokens)
    qt = get_format(fmt).quantize(torch.randn(rows + 3 * (fmt not in ("fp8_block",)), cols))
    stack = _one(qt)
    lid = executor.add_linear(stack)
    x = torch.randn(tokens, cols)
    fut = executor.submit_linear(x, lid)
    got = fut.wait()
    want = x @ get_format(fmt).dequantize(qt).T
    act = executor.linear_kernel(lid)[1]
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= TOLERANCE[act], (fmt, act, err)
    assert fut.weight_bytes == stack.expert_bytes  # every row read once, for all tokens


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k"])
def test_each_row_has_the_same_bits_in_every_batch_and_row_group(tier, fmt):
    """The row kernels read several rows at once (four for one or two vectors, two for more,
    the last rows one by one): a row's result for a vector has the same bits whatever the batch
    it comes in, the row count's remainder and the thread count (which sets the chunks)."""
    cols = SHAPES[fmt][0]
    for rows in (37, 38, 39, 40):
        torch.manual_seed(rows)
        lid_stack = _one(get_format(fmt).quantize(torch.randn(rows, cols) / cols**0.5))
        x = torch.randn(5, cols)
        outs = []
        for threads in (1, 3):
            ex = cx.CpuMoeExecutor(threads=threads, isa=tier)
            lid = ex.add_linear(lid_stack)
            outs.append([ex.run_linear(x[t:t + 1], lid)[0] for t in range(5)])
            for n in (2, 3, 5):
                outs.append(list(ex.run_linear(x[:n], lid)))
            ex.close()
        for batch in outs[1:]:
            for t, row in enumerate(batch):
                assert torch.equal(row, outs[0][t]), (fmt, rows, t)


@pytest.mark.parametrize("act", ["auto", "q8"])
@pytest.mark.parametrize("tier", TIERS)
def test_f32_router_is_float32_linear(monkeypatch, tier, act):
    """An f32 router (128 x 2048) registered as it is read: x @ W.T to float32 rounding under
    any ISA cap and activation mode, the activations never quantised."""
    monkeypatch.setenv("FREETOKEN_CPU_ISA", tier)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 2048, generator=g) / 2048**0.5
    x = torch.randn(5, 2048, generator=g)
    ex = cx.CpuMoeExecutor(threads=2, act=act)
    lid = ex.add_linear(cx.ExpertStack.from_quant(QuantTensor("f32", tuple(w.shape), w)))
    want_isa = cx.ISAS[min(cx.ISAS.index(tier), cx.ISAS.index("avx512"))]
    assert ex.linear_kernel(lid) == (want_isa, "f32")
    got = ex.submit_linear(x, lid).wait()
    want = torch.nn.functional.linear(x, w)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    ex.close()


def test_data_that_does_not_fit_the_format_is_refused():
    qt = QuantTensor("f32", (4, 8), torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="f32 rows of 8 take 32 bytes, but the data"):
        cx.ExpertStack.from_quant(qt)


def test_pool_linear_layer_loads_and_multiplies(pool):
    torch.manual_seed(0)
    qt = get_format("q8_0").quantize(torch.randn(48, 96))
    layer = PoolLinear(96, 48, pool)
    with pytest.raises(ValueError, match=r"the config implies \(48, 96\)"):
        layer.load_weight_tensor(get_format("q8_0").quantize(torch.randn(96, 96)))
    assert layer.missing_weight()
    layer.load_weight_tensor(qt)
    x = torch.randn(2, 3, 96)
    y = layer(x)
    want = x @ get_format("q8_0").dequantize(qt).T
    assert y.shape == (2, 3, 48) and not layer.missing_weight()
    assert float((y - want).abs().max() / want.abs().max()) <= TOLERANCE["q8"]


def _layers(pool: cx.CpuMoeExecutor, fmts: list[str], rows: list[int], cols: int,
            seed: int) -> list[PoolLinear]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for fmt, r in zip(fmts, rows, strict=True):
        layer = PoolLinear(cols, r, pool)
        layer.load_weight_tensor(get_format(fmt).quantize(torch.randn(r, cols, generator=g)))
        out.append(layer)
    return out


@pytest.mark.parametrize("fmts", [["q8_0"] * 3, ["q4_k"] * 3, ["q8_0", "q8_0", "bf16"]])
@pytest.mark.parametrize("tokens", [1, 3])
def test_grouped_layers_give_each_layer_its_own_output(pool, fmts, tokens):
    """q/k/v as one pool job (stacked rows) against three separate layers on the same weights:
    the same bits; a group whose formats differ runs its members alone."""
    from freetoken.layers.pool_linear import InputGroup

    rows, cols = [64, 32, 32], 256
    alone = _layers(pool, fmts, rows, cols, seed=1)
    grouped = _layers(pool, fmts, rows, cols, seed=1)
    group = InputGroup(grouped)
    for m in grouped:
        m.group = group
    for step in range(2):  # a new input each step: nothing is served from the last one
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(step))
        for a, b in zip(alone, grouped, strict=True):
            assert torch.equal(a(x), b(x))
    assert group.stacked == (len(set(fmts)) == 1)
    assert not any(m.missing_weight() for m in grouped)
    with pytest.raises(RuntimeError, match="loaded once"):  # the pool holds the old rows
        grouped[1].load_weight_tensor(get_format(fmts[1]).quantize(torch.randn(rows[1], cols)))


def test_a_member_called_again_on_the_same_input_recomputes(pool):
    from freetoken.layers.pool_linear import InputGroup

    alone = _layers(pool, ["q8_0"] * 2, [32, 32], 64, seed=2)
    grouped = _layers(pool, ["q8_0"] * 2, [32, 32], 64, seed=2)
    group = InputGroup(grouped)
    for m in grouped:
        m.group = group
    x = torch.randn(2, 64)
    assert torch.equal(grouped[0](x), alone[0](x))
    assert torch.equal(grouped[0](x), alone[0](x))  # its pending part was taken: a new job
    assert torch.equal(grouped[1](x), alone[1](x))


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "f16"])
def test_exact_router_keeps_its_weight_in_float32(pool, fmt):
    """A router in any checkpoint format goes to the pool as float32: its logits are torch's
    matmul of the dequantised weight, in float32 whatever the input dtype."""
    torch.manual_seed(4)
    qt = get_format(fmt).quantize(torch.randn(8, 64))
    layer = PoolLinear(64, 8, pool, exact=True)
    layer.load_weight_tensor(qt)
    assert layer.weight_q is not None and layer.weight_q.fmt == "f32"
    x = torch.randn(3, 64)
    want = torch.nn.functional.linear(x, get_format(fmt).dequantize(qt).float())
    got = layer(x.bfloat16())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x.bfloat16().float(),
                               get_format(fmt).dequantize(qt).float()), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
