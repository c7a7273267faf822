"""Dense matrices on the CPU pool: every format x ISA tier x batch against the quant modules'
torch reference, and a model whose dense layers run there against the resident model."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.pool_linear import PoolLinear
from freetoken.moe import cpu_executor as cx
from freetoken.quant import QuantTensor, get_format
from tests.moe.test_cpu_kernels import SHAPES, TIERS, TOLERANCE

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))


def _one(qt: QuantTensor) -> cx.ExpertStack:
    return cx.ExpertStack.from_quant(QuantTensor(
        qt.fmt, (1, *qt.shape), qt.data.unsqueeze(0),
        {k: v.reshape(1, *v.shape) for k, v in qt.scales.items()}))


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


def test_pool_linear_layer_loads_and_multiplies():
    torch.manual_seed(0)
    qt = get_format("q8_0").quantize(torch.randn(48, 96))
    layer = PoolLinear(96, 48)
    with pytest.raises(ValueError, match=r"the config implies \(48, 96\)"):
        layer.load_weight_tensor(get_format("q8_0").quantize(torch.randn(96, 96)))
    assert layer.missing_weight()
    layer.load_weight_tensor(qt)
    x = torch.randn(2, 3, 96)
    y = layer(x)
    want = x @ get_format("q8_0").dequantize(qt).T
    assert y.shape == (2, 3, 48) and not layer.missing_weight()
    assert float((y - want).abs().max() / want.abs().max()) <= TOLERANCE["q8"]
