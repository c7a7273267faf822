"""The native decode layer (csrc/decode_layer.cpp) against its slow twin, the model's modules
on the same weights and pool, and against the resident model."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.cpu.library import optional
from freetoken.kvcache.paged import PagedKV
from freetoken.layers.context import ForwardContext, Segment
from freetoken.layers.pool_linear import use_pool_linears
from freetoken.models import build_model
from freetoken.models.loader import load_weights
from freetoken.models.native_decode import attach_native_decode, why_not
from freetoken.moe.attach import attach_moe
from freetoken.moe.plan import MoEPlan
from freetoken.moe.strategy import LayerPlan
from tests.models.helpers import load_ours, our_logits

pytestmark = pytest.mark.skipif(optional("ft_decode_layer") is None,
                                reason="the native library is not built")
IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


@pytest.fixture(scope="module")
def gguf(tiny_qwen3_moe, tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / "m.gguf"
    return convert_to_gguf(open_checkpoint(tiny_qwen3_moe), path,
                           lambda n, s: "q8_0" if ".experts." in n or "proj" in n else "f32")


@cache
def _pool() -> CpuMoeExecutor:
    return CpuMoeExecutor(threads=1)


def _pool_model(path) -> torch.nn.Module:
    """The cpu strategy with the dense matrices on the pool too, as the runner builds it."""
    ckpt = open_checkpoint(path)
    model = build_model(ckpt.config, "cpu")
    use_pool_linears(model, _pool())
    load_weights(model, ckpt, torch.device("cpu"), progress=False)
    plan = MoEPlan(tuple(LayerPlan("cpu") for _ in ckpt.config.moe_layers), None, 1)
    attach_moe(model, plan, _pool())
    return model


def _modules_only(model: torch.nn.Module) -> list:
    saved = [layer.native for layer in model.model.layers]
    for layer in model.model.layers:
        layer.native = None
    return saved


def test_native_layers_give_the_modules_bits(gguf, monkeypatch):
    from freetoken.models.native_decode import NativeDecodeLayer

    model = _pool_model(gguf)
    assert attach_native_decode(model, _pool()) == 3  # the two MoE layers and the dense one
    assert why_not(model.model.layers[1]) is None
    calls = []
    real = NativeDecodeLayer.__call__
    monkeypatch.setattr(NativeDecodeLayer, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    native = our_logits(model, IDS, prefill=5)
    assert len(calls) == 3 * (len(IDS) - 5)  # every decode step of every layer
    _modules_only(model)
    modules = our_logits(model, IDS, prefill=5)
    assert torch.equal(native, modules)
    resident = our_logits(load_ours(gguf), IDS, prefill=5)  # dequantised f32, in torch
    torch.testing.assert_close(native, resident, atol=3e-2, rtol=3e-2)


@torch.inference_mode()
def test_batched_decode_steps(gguf):
    """Two sequences at different lengths decoding in one step, pages interleaved."""
    model = _pool_model(gguf)
    attach_native_decode(model, _pool())
    cfg = model.config
    kv = PagedKV(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    a, b = kv.allocate(4), kv.allocate(4)
    cpu = torch.device("cpu")

    def run(segs: list[Segment], ids: list[int]) -> torch.Tensor:
        return model(torch.tensor(ids), ForwardContext.build(kv, segs, cpu))

    run([Segment(a, 0, 7)], IDS[:7])
    run([Segment(b, 0, 3)], IDS[7:10])
    saved_k, saved_v = kv.k.clone(), kv.v.clone()
    steps = [([Segment(a, 7, 1), Segment(b, 3, 1)], [IDS[10], IDS[11]]),
             ([Segment(a, 8, 1), Segment(b, 4, 1)], [IDS[12], IDS[13]])]
    native = [run(*s) for s in steps]
    kv.k.copy_(saved_k)
    kv.v.copy_(saved_v)
    _modules_only(model)
    modules = [run(*s) for s in steps]
    for x, y in zip(native, modules, strict=True):
        assert x.shape == (2, cfg.vocab_size) and torch.equal(x, y)


def test_a_position_past_the_tables_is_an_error(gguf):
    model = _pool_model(gguf)
    attach_native_decode(model, _pool())
    layer = model.model.layers[0]
    cfg = model.config
    kv = PagedKV(cfg.num_layers, 128, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    pages = kv.allocate(128)
    far = cfg.max_position  # one past the rotary tables
    ctx = ForwardContext.build(kv, [Segment(pages, far, 1)], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="past the rotary tables"):
        layer(torch.randn(1, cfg.hidden_size), ctx)


@pytest.mark.parametrize("v_format", ["q8_0", "q5_0"], ids=["qkv-stacked", "qkv-apart"])
def test_gemma3_sandwich_layers_give_the_modules_bits(tiny_gemma3, tmp_path, v_format,
                                                      monkeypatch):
    """Gemma-3's layers (norms of both outputs, scales 1 + w, a 5-token sliding window on
    most layers, a GELU MLP, the head tied to the embedding) over 16 tokens, so the window
    slides; with v in another format than q and k, the three run as separate jobs."""
    from freetoken.models.native_decode import NativeDecodeLayer

    def fmt(name: str, shape) -> str:
        if "v_proj" in name:
            return v_format
        return "q8_0" if "proj" in name or "embed" in name else "f32"

    path = convert_to_gguf(open_checkpoint(tiny_gemma3), tmp_path / "g.gguf", fmt)
    ckpt = open_checkpoint(path)
    model = build_model(ckpt.config, "resident")
    use_pool_linears(model, _pool())
    load_weights(model, ckpt, torch.device("cpu"), progress=False)
    layers = model.model.layers
    assert attach_native_decode(model, _pool()) == len(layers)
    assert any(layer.self_attn.window for layer in layers)
    calls = []
    real = NativeDecodeLayer.__call__
    monkeypatch.setattr(NativeDecodeLayer, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    native = our_logits(model, IDS, prefill=3)
    assert len(calls) == len(layers) * (len(IDS) - 3)
    _modules_only(model)
    assert torch.equal(native, our_logits(model, IDS, prefill=3))
    resident = our_logits(load_ours(path), IDS, prefill=3)  # dequantised f32, in torch
    torch.testing.assert_close(native, resident, atol=5e-2, rtol=5e-2)
