"""Time one sampled token: ``engine/sample.py:sample`` on logits where the model leaves them
(the GPU's exponential race, or the CPU's multinomial) against the draw it replaces on a GPU
(filters on the device, the whole distribution copied to the host, torch.multinomial there);
and a batch's tokens (``--rows``, a decode step of that many sequences): ``sample_rows`` (one
draw for the greedy rows, one for the unseeded unfiltered ones) against ``sample`` row by row.

    python benchmarks/sample.py --vocab 151936 --device cuda --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import git_state, host, save_result  # noqa: E402
from freetoken.engine.sample import SamplingParams, generator, sample, sample_rows  # noqa: E402


def per_call_us(fn, device: str, calls: int) -> float:
    """Median of 5 timings of ``calls`` calls, in microseconds per call."""
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rows", type=int, default=16, help="sequences in the batch rows")
    p.add_argument("--label", default="")
    p.add_argument("--git-sha")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.vocab, device=args.device) * 3
    gen = generator(0, args.device)
    cpu_gen = torch.Generator().manual_seed(0)
    rows = {}
    for name, params in (("greedy", SamplingParams()),
                         ("temperature_1", SamplingParams(temperature=1.0)),
                         ("top_p_0.9", SamplingParams(temperature=1.0, top_p=0.9))):
        rows[name] = {"sample_us": per_call_us(lambda p=params: sample(logits, p, gen),
                                               args.device, args.calls)}
        if params.temperature and args.device == "cuda":
            def host_draw(p: SamplingParams = params) -> int:
                probs = torch.softmax(logits / p.temperature, dim=-1)
                return int(torch.multinomial(probs.cpu(), 1, generator=cpu_gen))
            rows[name]["host_multinomial_us"] = per_call_us(host_draw, args.device, args.calls)
        print(name, {k: round(v, 1) for k, v in rows[name].items()}, flush=True)
    batch = torch.randn(args.rows, args.vocab, device=args.device) * 3
    for name, params in (("batch_greedy", SamplingParams()),
                         ("batch_temperature_1", SamplingParams(temperature=1.0))):
        ps, gens = [params] * args.rows, [None] * args.rows
        rows[name] = {
            "rows": args.rows,
            "sample_rows_us": per_call_us(lambda ps=ps, gens=gens: sample_rows(batch, ps, gens),
                                          args.device, max(1, args.calls // 10)),
            "row_by_row_us": per_call_us(lambda p=params: [sample(r, p, None) for r in batch],
                                         args.device, max(1, args.calls // 10))}
        print(name, {k: round(v, 1) for k, v in rows[name].items()}, flush=True)
    result = {"bench": "sample", "label": args.label, **git_state(args.git_sha), **host(),
              "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "params": vars(args) | {"out": str(args.out)}, "rows": rows}
    save_result(args.out, f"sample-{args.label or args.device}", result)


if __name__ == "__main__":
    main()
