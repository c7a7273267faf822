#!/usr/bin/env bash
# GPU machine: where decode time goes for offload and hybrid on the gemma4-26b-a4b geometry
# (4 GB cache): host time per plan step, and a torch.profiler run (GPU busy share, CUDA
# runtime calls; the trace gzipped). STRATEGIES and TOKENS vary it.
# Run as: GIT_SHA=<commit> bash benchmarks/device/plan_trace.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
M=/tmp/gemma4-26b-a4b.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset gemma4-26b-a4b --device cuda \
  --router-skew 1 --router-locality 0.5 --out $M 2>&1 | tail -1
for s in ${STRATEGIES:-offload hybrid}; do
  python3 benchmarks/plan_profile.py --model $M --strategy $s --tokens ${TOKENS:-24} --trace \
    --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" > "$OUT/trace_$s.log"
  python3 - "$OUT/trace_$s.log" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
print(d["params"]["strategy"], f"{d['tokens_per_s']:.1f} tok/s")
for k, v in list(d["steps"].items())[:8]:
    print(f"  {k}: {v['us_per_call']:.0f} us x {v['calls']}")
print(json.dumps(d.get("trace"), indent=1)[:2500])
PY
done
