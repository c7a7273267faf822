"""GPT-OSS's biased experts with the clamped SwiGLU on the CPU kernels (the cpu strategy, and
hybrid's CPU share) against resident's torch path, on the tiny random checkpoint: f32 experts
(kept as bf16), q8_0 and mxfp4 GGUF experts."""

from __future__ import annotations

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.checkpoint.convert import convert_to_gguf
from freetoken.config import CacheSizing
from freetoken.moe.offload import offload_stats
from tests.models.helpers import load_ours, our_greedy, our_logits

IDS = [1, 17, 99, 3, 250, 42]
STEPS = 24
# the kernels' rounding (bf16 or int8 activations) moves these logits (span ~0.5) by at most
# 1.7e-4; without the clamp they move by 5e-3, without the biases by 0.28
TOL = 1e-3


def _gguf(src, out, experts: str):
    return convert_to_gguf(open_checkpoint(src), out,
                           lambda n, s: experts if ".experts." in n and len(s) == 3 else "f32")


@pytest.fixture(scope="module")
def native_ready():
    from freetoken.cpu import executor as cx

    if (why := cx.available()) is not None:
        pytest.skip(why)


@pytest.mark.parametrize("experts", ["bf16", "q8_0", "mxfp4"])
@pytest.mark.parametrize("strategy", ["cpu", "hybrid"])
def test_native_strategies_follow_resident(native_ready, tiny_gpt_oss, tmp_path, monkeypatch,
                                           strategy, experts):
    """Logits teacher-forced on resident's greedy continuation within the kernels' rounding,
    the same argmax wherever resident's margin clears twice that; hybrid's split held fixed."""
    monkeypatch.setenv("FREETOKEN_BENCHBW_PATH", str(tmp_path / "none.json"))
    path = _gguf(tiny_gpt_oss, tmp_path / "m.gguf", experts)
    resident = load_ours(path)
    want = our_greedy(resident, IDS, STEPS)
    ref = our_logits(resident, IDS + want, prefill=len(IDS))
    other = load_ours(path, strategy=strategy, cache=CacheSizing("size", 3), max_fetch=1,
                      online=False)
    got = our_logits(other, IDS + want, prefill=len(IDS))
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    top2 = ref[len(IDS) - 1:-1].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * TOL
    assert clear.sum() >= STEPS // 2
    assert got[len(IDS) - 1:-1].argmax(-1)[clear].tolist() == torch.tensor(want)[clear].tolist()
    if strategy == "hybrid":  # the CPU computed some misses, the device fetched others
        layers = offload_stats(other)["layers"].values()
        assert sum(s["cpu_experts"] for s in layers) > 0 and sum(s["misses"] for s in layers) > 0
