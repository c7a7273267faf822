"""Decode speed of `ft generate`'s engine path, next to the weight-streaming roofline.

Roofline: each decode step reads every active weight once (attention, router, the top-k experts
of every MoE layer, the head), so tokens/s <= device read bandwidth / active bytes per token.
The bandwidth is measured in the same run (a large on-device copy; host memcpy on CPU).

    python benchmarks/generate.py --model M.gguf --device cuda --tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.config import EngineConfig, ModelConfig  # noqa: E402
from freetoken.engine.engine import Engine, GenerationStats  # noqa: E402
from freetoken.engine.sample import SamplingParams  # noqa: E402


def active_bytes_per_token(cfg: ModelConfig, bytes_per_param: float) -> float:
    """Weight bytes one decode step reads: attention + dense MLPs + top-k experts + head."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = H * D * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer = []
    for moe in cfg.moe_layers:
        if moe:
            mlp = cfg.top_k * 3 * H * cfg.moe_intermediate_size + cfg.num_experts * H
        else:
            mlp = 3 * H * cfg.intermediate_size
        per_layer.append(attn + mlp)
    return (sum(per_layer) + cfg.vocab_size * H) * bytes_per_param


def read_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a large copy (counted as read + write) on ``device``."""
    n = int(gib * (1 << 30)) // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt", default="The history of computing")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-graph-max-bs", type=int, default=16)
    p.add_argument("--label", default="")
    p.add_argument("--git-sha", help="commit of the tree when it has no .git (copied trees)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()

    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                 moe_strategy="resident", max_seq_len=args.tokens + 256,
                                 cuda_graph_max_bs=args.cuda_graph_max_bs
                                 if args.device == "cuda" else 0))
    load_s = time.perf_counter() - t0
    ids = engine.encode(args.prompt)
    params = SamplingParams(max_tokens=args.tokens)
    engine.generate(ids, SamplingParams(max_tokens=8))  # warm-up
    runs = []
    for _ in range(args.repeats):
        stats = GenerationStats()
        engine.generate(ids, params, stats=stats)
        runs.append({"output_tokens": stats.output_tokens, "prefill_s": stats.prefill_s,
                     "decode_tokens_per_s": stats.decode_tokens_per_s})
    device = torch.device(args.device)
    bw = read_bandwidth(device)
    per_param = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    active = active_bytes_per_token(engine.model_config, per_param)
    roofline = bw / active
    best = max(r["decode_tokens_per_s"] for r in runs)
    result = {
        "bench": "generate", "label": args.label, **git_state(args.git_sha),
        **host(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "params": vars(args) | {"out": str(args.out)},
        "model_config": engine.model_config.family, "load_s": load_s,
        "prompt_tokens": len(ids), "runs": runs,
        "device_copy_bytes_per_s": bw, "active_bytes_per_token": active,
        "roofline_tokens_per_s": roofline, "decode_tokens_per_s": best,
        "fraction_of_roofline": best / roofline,
    }
    print(json.dumps(result, indent=2))
    save_result(args.out, f"generate-{args.label or Path(args.model).stem}-{args.device}", result)


if __name__ == "__main__":
    main()
