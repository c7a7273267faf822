"""Where a model's CUDA run departs from its CPU run: the same checkpoint loaded on both, the
same prompt (a prefill, then one token at a time), every module's output recorded per step and
the first ones whose largest difference passes --atol printed in call order.

    python scripts/device_diff.py --model tiny-gpt-oss/ --prefill 9
    python scripts/device_diff.py --tiny gpt-oss          # writes the tests' tiny checkpoint
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.models.helpers import load_ours, our_logits  # noqa: E402

IDS = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 9, 77, 180]


def tiny_gpt_oss(out: Path) -> Path:
    """The tests' tiny GPT-OSS (tests/conftest.py) without pytest."""
    from tests import conftest

    fn = getattr(conftest.tiny_gpt_oss, "__wrapped__", conftest.tiny_gpt_oss)

    class Factory:
        def mktemp(self, name: str) -> Path:
            p = out / name
            p.mkdir(parents=True, exist_ok=True)
            return p

    return fn(Factory())


def record(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: list[tuple[str, torch.Tensor]] = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def hook(_m, _i, out, name=name) -> None:
            if isinstance(out, torch.Tensor):
                seen.append((name, out.detach().float().cpu().clone()))
        mod.register_forward_hook(hook)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--tiny", choices=["gpt-oss"])
    p.add_argument("--prefill", type=int, default=9)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--show", type=int, default=12)
    p.add_argument("--devices", default="cpu,cuda", help="the two devices compared")
    a = p.parse_args()
    path = a.model or tiny_gpt_oss(Path(tempfile.mkdtemp()))
    runs = {}
    devs = a.devices.split(",")
    for dev in devs:
        model = load_ours(path, device=dev)
        seen = record(model)
        logits = our_logits(model, IDS, prefill=a.prefill, device=dev)
        runs[dev] = (seen, logits)
    (cs, cl), (gs, gl) = runs[devs[0]], runs[devs[-1]]
    print(f"logits: max |cpu - cuda| = {(cl - gl).abs().max():.3g}; "
          f"per row: {[round(float(r), 5) for r in (cl - gl).abs().amax(-1)]}")
    shown = 0
    for i, ((n1, t1), (n2, t2)) in enumerate(zip(cs, gs, strict=False)):
        if n1 != n2 or t1.shape != t2.shape:
            print(f"call {i}: cpu {n1} {tuple(t1.shape)} / cuda {n2} {tuple(t2.shape)} differ")
            break
        d = float((t1 - t2).abs().max()) if t1.numel() else 0.0
        if d > a.atol:
            print(f"call {i}: {n1} {tuple(t1.shape)} max diff {d:.3g} "
                  f"(scale {float(t1.abs().max()):.3g})")
            shown += 1
            if shown >= a.show:
                break


if __name__ == "__main__":
    main()
