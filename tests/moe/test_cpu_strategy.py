"""The cpu strategy: experts handed over in their checkpoint format, computed on the CPU
executor, against the resident strategy's slow twin on the same (dequantised) weights."""

from __future__ import annotations

import pytest
import torch

from freetoken.cpu import executor as cx
from freetoken.errors import ConfigError
from freetoken.moe.cpu import CpuExperts
from freetoken.moe.registry import make_experts, strategy_names
from freetoken.moe.resident import ResidentExperts, reference_experts
from freetoken.moe.strategy import ExpertShape, LayerPlan, Shared
from freetoken.quant import QuantTensor, get_format

pytestmark = pytest.mark.skipif(cx.available() is not None, reason=str(cx.available()))

SHAPE = ExpertShape(layer=7, num_experts=8, hidden=64, intermediate=96, top_k=2,
                    activation="silu")


@pytest.fixture(scope="module")
def pool() -> cx.CpuMoeExecutor:
    return cx.CpuMoeExecutor(threads=1)


def _attach(experts: CpuExperts, pool: cx.CpuMoeExecutor) -> CpuExperts:
    """As the runner does once the weights are loaded: the banks go to the pool."""
    experts.attach(LayerPlan("cpu"), Shared(pool=pool))
    assert experts.registered
    return experts


def _weights(fmt: str) -> dict[str, QuantTensor]:
    g = torch.Generator().manual_seed(1)
    E, H, I_ = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate
    q = get_format(fmt)
    return {"gate_proj": q.quantize(torch.randn(E, I_, H, generator=g) / 8),
            "up_proj": q.quantize(torch.randn(E, I_, H, generator=g) / 8),
            "down_proj": q.quantize(torch.randn(E, H, I_, generator=g) / 10)}


def _twin(weights: dict[str, QuantTensor]) -> ResidentExperts:
    twin = ResidentExperts(SHAPE)
    with torch.no_grad():
        for name, qt in weights.items():
            getattr(twin, name).copy_(get_format(qt.fmt).dequantize(qt))
    return twin


def _route(T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, SHAPE.hidden, generator=g)
    ids = torch.stack([torch.randperm(SHAPE.num_experts, generator=g)[:2] for _ in range(T)])
    return x, ids, torch.softmax(torch.randn(T, 2, generator=g), -1)


def test_cpu_is_a_registered_strategy() -> None:
    assert "cpu" in strategy_names()
    assert isinstance(make_experts("cpu", SHAPE), CpuExperts)


@pytest.mark.parametrize("fmt", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("how", ["stacked", "per_expert", "fused"])
def test_matches_resident_twin(fmt: str, how: str, pool: cx.CpuMoeExecutor) -> None:
    weights = _weights(fmt)
    experts = CpuExperts(SHAPE)
    if how == "stacked":
        for name, qt in weights.items():
            assert experts.load_expert_tensor(name, qt)
    elif how == "fused":
        g, u = weights["gate_proj"], weights["up_proj"]
        fused = QuantTensor(fmt, (8, 192, 64), torch.cat([g.data, u.data], 1))
        experts.load_expert_tensor("gate_up_proj", fused)
        experts.load_expert_tensor("down_proj", weights["down_proj"])
    else:
        for name, qt in weights.items():
            for e in range(SHAPE.num_experts):
                assert experts.missing_expert_tensors()
                experts.load_expert_tensor(name, QuantTensor(fmt, qt.shape[1:], qt.data[e]), e)
    assert experts.missing_expert_tensors() == []
    _attach(experts, pool)
    x, ids, w = _route(5)
    want = reference_experts(_twin(weights), x, ids, w)
    got = experts(x.to(torch.bfloat16), ids, w.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max() / want.abs().max()) < 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_between_graph_pieces_gives_the_eager_bits(dtype: torch.dtype,
                                                             pool: cx.CpuMoeExecutor) -> None:
    """Between decode graph pieces the pool's job reads the pinned host copies of the inputs
    (of the model's dtype) and writes into the pinned buffer the next piece copies in: the
    eager call's numbers, bit for bit, call after call on the same buffers."""
    from freetoken.moe.host_steps import HostCopies

    experts = CpuExperts(SHAPE)
    for name, qt in _weights("q8_0").items():
        experts.load_expert_tensor(name, qt)
    _attach(experts, pool)
    T = 3
    host = HostCopies(torch.empty(T, SHAPE.hidden, dtype=dtype),
                      torch.empty(T, 2, dtype=torch.int64), torch.empty(T, 2, dtype=dtype),
                      torch.full((T, SHAPE.hidden), float("nan")))
    nan = float("nan")
    for step in range(3):
        x, ids, w = _route(T + step)
        x, ids, w = x[:T].to(dtype), ids[:T], w[:T].to(dtype)
        eager = experts(x.float(), ids, w.float())
        host.x.copy_(x), host.ids.copy_(ids), host.w.copy_(w)
        # the step reads the host copies, never the device inputs
        got = experts._host_step(torch.full_like(x, nan), ids, torch.full_like(w, nan), host)
        assert got.data_ptr() == host.cpu_out.data_ptr()
        torch.testing.assert_close(got, eager, rtol=0, atol=0)
    times = experts.host_times  # counted for the bench's breakdown: the job within the step
    assert times.calls == 3 and 0 < times.job_s <= times.step_s


def test_missing_weights_are_named(pool: cx.CpuMoeExecutor) -> None:
    experts = CpuExperts(SHAPE)
    experts.load_expert_tensor("gate_proj", _weights("bf16")["gate_proj"])
    qt = _weights("bf16")["up_proj"]
    experts.load_expert_tensor("up_proj", QuantTensor("bf16", qt.shape[1:], qt.data[0]), 0)
    assert experts.missing_expert_tensors()[:2] == ["up_proj[1]", "up_proj[2]"]
    with pytest.raises(ConfigError, match=r"layer 7: the cpu strategy was not given .*up_proj"):
        _attach(experts, pool)


def test_wrong_shape_is_refused() -> None:
    experts = CpuExperts(SHAPE)
    with pytest.raises(ValueError, match="down_proj: shape"):
        experts.load_expert_tensor("down_proj", _weights("bf16")["gate_proj"])


def test_refuses_to_start_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cx, "available", lambda: "the library was not built")
    with pytest.raises(ConfigError, match="--moe-strategy cpu needs the CPU MoE library"):
        CpuExperts(SHAPE)
