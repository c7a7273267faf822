"""Record llama.cpp's greedy decodes of small synthetic checkpoints that ``ft synth`` writes
(a GPT-OSS one by default), so tests can hold our reading of that architecture's GGUF against
llama.cpp's without llama.cpp installed.

The JSON (``tests/data/<preset>_synth_llamacpp.json``) holds the synth spec (preset, the
geometry overrides, seed), the file's sha256 (the test writes the file again and checks it is
the same bytes), and per prompt of random ids the greedy ids and top-2 margins, decoded as
``scripts/llamacpp_reference.py`` decodes (float32 KV, argmax of the float32 logits). A random
model is rarely sure of its next token, so of ``--candidates`` prompts the ``--prompts`` whose
runs stay longest at top-2 margins of ``--clear`` or more are kept.

    python scripts/llamacpp_synth_reference.py --preset gpt-oss-20b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamacpp_reference import greedy_ids, open_llama, sha256_of  # noqa: E402

from freetoken.checkpoint.synth import (  # noqa: E402
    PRESETS,
    SynthSpec,
    parse_expert_formats,
    write_synth,  # noqa: E402
)

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
# Small enough to write in a second, large enough for every format's blocks and a window
GEOMETRY = dict(hidden=128, moe_intermediate=128, experts=8, layers=4, heads=4, kv_heads=2,
                head_dim=32, vocab=1024, sliding_window=8)


def spec_of(record: dict[str, Any]) -> SynthSpec:
    """The synth spec a record names (the test's way back to the same file)."""
    p = replace(PRESETS[record["preset"]], **record["geometry"])
    return SynthSpec(p, parse_expert_formats(p.expert_format, p.layers), seed=record["seed"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of random ids kept")
    parser.add_argument("--candidates", type=int, default=400, help="prompts tried")
    parser.add_argument("--clear", type=float, default=0.25,
                        help="the top-2 margin a kept prompt's run stays at longest")
    parser.add_argument("--n-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument("--out", type=Path, help="output JSON (default: tests/data/...)")
    args = parser.parse_args(argv)

    import llama_cpp

    record: dict[str, Any] = {"preset": args.preset, "geometry": GEOMETRY, "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_synth(spec_of(record), Path(tmp) / f"{args.preset}.gguf")
        llm = open_llama(path, args.threads)
        rng = random.Random(0)
        cases = []
        for _ in range(args.candidates):
            ids = [rng.randrange(GEOMETRY["vocab"]) for _ in range(rng.randrange(4, 12))]
            out, margins = greedy_ids(llm, llama_cpp, ids, args.n_tokens)
            cases.append({"prompt_ids": ids, "output_ids": out, "margins": margins})

        def clear_run(case: dict[str, Any]) -> int:
            return next((i for i, m in enumerate(case["margins"]) if m < args.clear),
                        args.n_tokens)

        cases = sorted(cases, key=clear_run, reverse=True)[:args.prompts]
        record |= {"sha256": sha256_of(path), "llama_cpp_python": llama_cpp.__version__,
                   "n_tokens": args.n_tokens, "kv_type": "f32", "kept_for_clear": args.clear,
                   "cases": cases}
    out = args.out or DATA / f"{args.preset.replace('-', '_')}_synth_llamacpp.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    for c in cases:
        print(f"{c['prompt_ids']} -> {c['output_ids'][:8]} min margin {min(c['margins']):.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
