#!/usr/bin/env bash
# GPU machine: where decode time goes (4 GB cache, FORMAT experts, default q8_0): host time
# per plan step, and a torch.profiler run (GPU busy time against the wall, the kernels that fill it, CUDA runtime
# calls; the trace gzipped). PRESET (default gemma4-26b-a4b), LAYERS (default: the preset's),
# ROUTER (default the skewed router "--router-skew 1 --router-locality 0.5"; "" for the
# default one), STRATEGIES (hybrid-fetch, hybrid-split, hybrid-cpu: hybrid with its wall check
# held at that arm), TOKENS and TEMPERATURE (default 1) vary it; CPROFILE=1 adds a
# cProfile run (the Python functions with the most own time per token).
# Run as: GIT_SHA=<commit> bash benchmarks/device/plan_trace.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
PRESET=${PRESET:-gemma4-26b-a4b}
FORMAT=${FORMAT:-q8_0}
M=/tmp/$PRESET-${LAYERS:-all}-$FORMAT.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET ${LAYERS:+--layers $LAYERS} \
  --expert-format $FORMAT --device cuda ${ROUTER---router-skew 1 --router-locality 0.5} --out $M 2>&1 | tail -1
for s in ${STRATEGIES:-offload hybrid}; do
  hold=${s#*-}; [ "$hold" = "$s" ] && hold=
  python3 benchmarks/plan_profile.py --model $M --strategy ${s%%-*} ${hold:+--hold $hold} --tokens ${TOKENS:-24} --trace \
    --temperature ${TEMPERATURE:-1} ${CPROFILE:+--cprofile} \
    --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | tr '\r' '\n' | grep -v "^Loading" > "$OUT/trace_$s.log"
  grep -E "^(WARNING|ERROR)|GPU expert kernel" "$OUT/trace_$s.log"
  python3 - "$OUT/trace_$s.log" ${TOKENS:-24} <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("\n{") + 1:])
n = int(sys.argv[2])
print(d["params"]["strategy"], f"{d['tokens_per_s']:.1f} tok/s", d.get("gpu_expert_kernels"))
for k, v in list(d["steps"].items())[:8]:
    print(f"  {k}: {v['us_per_call']:.0f} us x {v['calls']}")
t = d.get("trace") or {}
print(f"  GPU span {t.get('gpu_span_us', 0) / n:.0f} us/token, busy {t.get('gpu_busy_us', 0) / n:.0f}")
for k, v in (t.get("kernels") or {}).items():
    print(f"  {v['us_total'] / n:8.1f} us/token {v['calls'] / n:6.1f}/token  {k}")
print(json.dumps(t.get("runtime_calls"), indent=1)[:1500])
for r in (d.get("cprofile") or [])[:30]:
    print(f"  {r['own_us_per_token']:8.0f} us own {r['total_us_per_token']:8.0f} total "
          f"{r['calls_per_token']:6.1f}/token  {r['function']}")
PY
done
