#!/usr/bin/env bash
# GPU machine: resident experts kept as blocks (fused kernels) against dequantised to bf16.
# The CUDA tests of the packages it touches; the fused kernels timed in a CUDA graph with a
# sweep of their launch choices (benchmarks/gather_gemv.py --sweep); then decode on a LAYERS
# (default 12) layer default-router qwen3-30b-a3b q8_0 file at temperature 1, each strategy
# with its `+dequant` twin in the same run (CACHE: default 1GB, 4 GB's share of 48 layers);
# and a torch.profiler kernel list of resident.
# SKIP_TESTS, SKIP_SWEEP and STRATEGIES=none leave those parts out.
# Run as: GIT_SHA=<commit> bash benchmarks/device/resident_blocks.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
build_cpu_library
moe_bench_setup
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/moe tests/kernels tests/layers \
    tests/engine tests/models --deselect tests/engine/test_moeified_gemma.py \
    > "$OUT/cuda_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -20
fi
[ -n "${SKIP_SWEEP:-}" ] || python3 benchmarks/gather_gemv.py --sweep --shape 2048x768 \
  --formats ${FORMATS:-q8_0} --label $GPU-sweep-2048x768 --out "$OUT" \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^  rows"
L=${LAYERS:-12}
M=/tmp/qwen3-30b-a3b-${L}l.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers $L \
  --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1
[ "${STRATEGIES:-}" = none ] || python3 benchmarks/decode_moe.py --model $M --device cuda --temperature 1 \
  --strategies ${STRATEGIES:-resident+dequant,resident,offload,hybrid-online} \
  --moe-cache-mem ${CACHE:-1GB} --moe-cpu-threads 15 --tokens 64 --repeats 2 \
  --label qwen3-30b-a3b-${L}l-blocks --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 \
  | grep -v "^Loading" | grep -E '"(strategy|decode_tokens_per_s|hit_rate)"|rror|resident experts'
python3 benchmarks/plan_profile.py --model $M --strategy resident --tokens 24 --trace \
  --out "$OUT" --git-sha "${GIT_SHA:-}" > "$OUT/trace_resident.log" 2>&1
python3 - "$OUT/trace_resident.log" 24 <<'PY'
import json, sys
text = open(sys.argv[1]).read()
d = json.loads(text[text.index("{"):])
n = int(sys.argv[2])
t = d.get("trace") or {}
print("resident", f"{d['tokens_per_s']:.1f} tok/s under the profiler;",
      f"GPU busy {t.get('gpu_busy_us', 0) / n:.0f} us/token")
for k, v in list((t.get("kernels") or {}).items())[:14]:
    print(f"  {v['us_total'] / n:8.1f} us/token {v['calls'] / n:6.1f}/token  {k[:90]}")
PY
