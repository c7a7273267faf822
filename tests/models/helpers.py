"""Run our model over a token sequence: one prefill chunk, then token-by-token decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from freetoken.checkpoint import open_checkpoint
from freetoken.config import CacheSizing, EngineConfig
from freetoken.cpu.executor import CpuMoeExecutor
from freetoken.kvcache.paged import PagedKV
from freetoken.layers.block_linear import use_block_linears
from freetoken.layers.context import ForwardContext, Segment
from freetoken.models import build_model
from freetoken.models.loader import load_weights
from freetoken.moe.attach import attach_moe
from freetoken.moe.plan import plan_moe


def load_ours(path: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu",
              strategy: str = "resident", cache: CacheSizing | None = None, threads: int = 1,
              max_fetch: int | str = "auto", lookahead: str = "auto",
              online: bool = True, act: str = "auto", dense_blocks: bool = False,
              max_seq_len: int = 64) -> torch.nn.Module:
    """Our model on ``device`` as the runner builds it, without a KV pool: the MoE plan for
    ``strategy``, offloaded layers with an expert cache sized by ``cache``, a CPU pool of one
    worker (planned as ``threads``, the count a profile row is looked up for) where needed;
    ``lookahead`` as ``--moe-lookahead``, ``online`` as ``--moe-hybrid-online``; rope tables of
    ``max_seq_len`` positions; ``act``: how the pool's int kernels read activations (the engine
    runs ``auto``; ``f32`` takes their rounding out); ``dense_blocks``: Q8_0 dense matrices as
    blocks where the runner would swap them (FREETOKEN_GPU_DENSE=blocks on a GPU)."""
    ckpt = open_checkpoint(path)
    cfg = EngineConfig(model=str(path), device=device, dtype=str(dtype).split(".")[1],
                       moe_strategy=strategy, max_seq_len=max_seq_len, moe_cpu_threads=threads,
                       moe_cache=cache or CacheSizing("rate", 1.0), moe_hybrid_max_fetch=max_fetch,
                       moe_lookahead=lookahead, moe_hybrid_online=online)
    plan = plan_moe(cfg, ckpt, torch.device(device))
    pool = CpuMoeExecutor(threads=1, act=act) if plan.pool_threads else None
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(ckpt.config, plan.strategies, cfg.max_seq_len)
    finally:
        torch.set_default_dtype(prev)
    if dense_blocks:
        use_block_linears(model, ckpt)
    load_weights(model, ckpt, torch.device(device), progress=False)
    attach_moe(model, plan, pool)
    return model


@torch.inference_mode()
def our_logits(
    model: torch.nn.Module, ids: list[int], prefill: int, device: str = "cpu"
) -> torch.Tensor:
    """Logits (len(ids), vocab): first ``prefill`` tokens in one forward, the rest one by one."""
    cfg, dev = model.config, torch.device(device)
    p = next(model.parameters())
    page = 4  # small pages: a sequence spans several, in a scrambled order
    kv = PagedKV(cfg.num_layers, -(-len(ids) // page) + 3, page, *cfg.kv_shape, p.dtype,
                 device)
    pages = kv.allocate(kv.num_pages)[::-1][: -(-len(ids) // page)]
    windows = (0, cfg.sliding_window) if any(cfg.sliding_layers) else (0,)
    t = torch.tensor(ids, device=device)

    def run(start: int, end: int) -> torch.Tensor:
        ctx = ForwardContext.build(kv, [Segment(pages, start, end - start)], dev, windows, True)
        return model(t[start:end], ctx)

    out = [run(0, prefill)] + [run(i, i + 1) for i in range(prefill, len(ids))]
    return torch.cat(out).float().cpu()


def skip_where_hf_ignores_the_clamp(path: Path | str) -> None:
    """Skip a comparison with ``transformers`` on a GPT-OSS directory whose ``swiglu_limit``
    the installed ``transformers`` does not read: some releases (5.17 among them) clamp at a
    fixed 7.0 whatever the config says, so a tiny checkpoint with a lower limit cannot match
    them. A probe of its expert module, not a version list, decides."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return
    cfg = json.loads(config.read_text())
    if cfg.get("model_type") != "gpt_oss" or "swiglu_limit" not in cfg:
        return
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    probe = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=2,
                                       swiglu_limit=cfg["swiglu_limit"]))
    if getattr(probe, "limit", None) != cfg["swiglu_limit"]:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} clamps GPT-OSS's experts at "
                    f"{probe.limit}, not at the config's swiglu_limit {cfg['swiglu_limit']}")


@torch.inference_mode()
def hf_logits(path: Path | str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    skip_where_hf_ignores_the_clamp(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def our_greedy(model: torch.nn.Module, prompt: list[int], steps: int,
               device: str = "cpu") -> list[int]:
    """``steps`` greedy tokens after ``prompt``: one prefill forward, then one token a step."""
    cfg, dev = model.config, torch.device(device)
    p = next(model.parameters())
    page, total = 4, len(prompt) + steps
    kv = PagedKV(cfg.num_layers, -(-total // page) + 1, page, *cfg.kv_shape, p.dtype, device)
    pages = kv.allocate(kv.num_pages)[::-1][: -(-total // page)]
    windows = (0, cfg.sliding_window) if any(cfg.sliding_layers) else (0,)
    out: list[int] = []
    ids, start = list(prompt), 0
    while len(out) < steps:
        ctx = ForwardContext.build(kv, [Segment(pages, start, len(ids) - start)], dev, windows)
        logits = model(torch.tensor(ids[start:], device=device), ctx)
        start = len(ids)
        ids.append(int(logits[-1].argmax()))
        out.append(ids[-1])
    return out


@torch.inference_mode()
def hf_greedy(path: Path | str, prompt: list[int], steps: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    skip_where_hf_ignores_the_clamp(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False)
    return got[0, len(prompt):].tolist()
