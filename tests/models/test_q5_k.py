"""Q5_K weights (what a Q5_K_M GGUF mostly holds) from a GGUF: transformers' logits on the same
values (dequantised by the gguf package), and the strategies that can run them. The CPU
kernels do not read q5_k yet: auto keeps those layers off them (with a log line), an explicit
cpu or hybrid is refused naming the fix, and the CPU pool keeps q5_k dense weights as bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing, EngineConfig
from freetoken.errors import ConfigError
from freetoken.moe.plan import plan_moe
from freetoken.quant import get_format
from tests.models.helpers import hf_logits, load_ours, our_logits

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200]


def q5_k_here(name: str, shape: tuple[int, ...]) -> str:
    """Every projection (the experts' stacked ones too) whose rows are whole q5_k
    super-blocks; the rest (embedding, router, norms) stays f32."""
    proj = name.endswith("proj.weight") or ".experts." in name
    return "q5_k" if proj and shape[-1] % 256 == 0 else "f32"


@pytest.fixture(scope="module")
def q5_k_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A small Qwen3-MoE at q5_k's block size written by transformers, its GGUF with q5_k
    projections, and the HF model holding the values the gguf package reads from that GGUF."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=512,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], max_position_embeddings=256, rope_theta=10000.0,
    )
    model = Qwen3MoeForCausalLM(cfg)
    root = tmp_path_factory.mktemp("q5_k")
    model.save_pretrained(root / "hf")
    gguf = convert_to_gguf(open_checkpoint(root / "hf"), root / "q5_k.gguf", q5_k_here)
    fmt = get_format("q5_k")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if q5_k_here(name, tuple(p.shape)) == "q5_k":
                raw = fmt.quantize(p.detach().float()).data.numpy()
                p.copy_(torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType.Q5_K)))
    model.save_pretrained(root / "reference")
    return gguf, root / "reference"


def test_logits_match_transformers_on_the_values_gguf_reads(q5_k_model):
    gguf, reference = q5_k_model
    ours = our_logits(load_ours(gguf), IDS, prefill=4)
    torch.testing.assert_close(ours, hf_logits(reference, IDS), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_offload_gives_residents_logits(q5_k_model, device):
    """Offload's slots hold the q5_k blocks (no fused kernel reads them: dequantise + matmul)
    and give resident's logits; on the CPU bit for bit."""
    gguf, reference = q5_k_model
    resident = our_logits(load_ours(gguf, device=device), IDS, prefill=4, device=device)
    offload = load_ours(gguf, device=device, strategy="offload", cache=CacheSizing("size", 3))
    got = our_logits(offload, IDS, prefill=4, device=device)
    if device == "cpu":
        assert torch.equal(got, resident)
    else:
        torch.testing.assert_close(got, resident, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.cpu(), hf_logits(reference, IDS), atol=2e-3, rtol=1e-3)


def test_auto_keeps_q5_k_layers_off_the_cpu_kernels(q5_k_model, caplog):
    from freetoken.cpu import executor as cx

    if (why := cx.available()) is not None:  # auto would not pick the CPU kernels anyway
        pytest.skip(why)
    gguf, _ = q5_k_model
    ckpt = open_checkpoint(gguf)
    with caplog.at_level("INFO"):
        plan = plan_moe(EngineConfig(model=str(gguf), device="cpu", dtype="float32",
                                     moe_strategy="auto", max_seq_len=64), ckpt,
                        torch.device("cpu"))
    assert plan.strategies == ("resident",) * 3
    assert "layers 0, 2: the CPU kernels do not read q5_k experts yet; auto runs them on " \
        "resident instead" in caplog.text
    for strategy in ("cpu", "hybrid"):
        with pytest.raises(ConfigError, match=rf"--moe-strategy {strategy} cannot run layers "
                           r"0, 2: the CPU kernels do not read q5_k experts yet; use "
                           r"--moe-strategy offload or resident"):
            plan_moe(EngineConfig(model=str(gguf), device="cpu", dtype="float32",
                                  moe_strategy=strategy, max_seq_len=64), ckpt,
                     torch.device("cpu"))


def test_the_pool_keeps_q5_k_dense_weights_as_bf16(caplog):
    """A dense q5_k matrix on the CPU pool (``--cpu-dense pool``): said once in the log, and
    computed as the same values rounded to bf16, which the pool reads."""
    from freetoken.cpu import executor as cx
    from freetoken.layers.pool_linear import PoolLinear

    if (why := cx.available()) is not None:
        pytest.skip(why)
    torch.manual_seed(1)
    q5 = get_format("q5_k").quantize(torch.randn(48, 512) / 512**0.5)
    values = get_format("q5_k").dequantize(q5)
    pool = cx.CpuMoeExecutor(threads=1)
    try:
        with caplog.at_level("INFO"):
            layers = [PoolLinear(512, 48, pool) for _ in range(3)]
            layers[0].load_weight_tensor(q5)
            layers[1].load_weight_tensor(q5)
            layers[2].load_weight_tensor(get_format("bf16").quantize(values))
        assert caplog.text.count("q5_k dense weights: the CPU pool's kernels do not read them "
                                 "yet; the pool keeps them as bf16") <= 1
        x = torch.randn(3, 512)
        got, again, as_bf16 = (m(x) for m in layers)
        assert torch.equal(got, as_bf16) and torch.equal(got, again)
        want = x @ values.T
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2
    finally:
        pool.close()
