#!/usr/bin/env bash
# GPU machine, one short call: the changes that are off until a GPU measures them, each against
# what runs today, in the order that needs the least device time first:
#   1. one layer's fused kernels, Q8_0 against Q8_0x8 (benchmarks/gather_gemv.py, no file);
#   2. a CPU job on experts read ahead against evicted ones, on the box's own CPU
#      (benchmarks/cpu_warm.py, THREADS);
#   3. the CUDA tests of those changes (TESTS_S seconds at most);
#   4. decode on a LAYERS-layer q8_0 file (default 24, written while 1-3 run): `cpu` against
#      `cpu+warm` and `resident` against `resident+regrouped` (STRATEGIES), 4 GB cache,
#      temperature 1, THREADS threads. No llama.cpp here: the ratios are ours against ours.
# Run as: GIT_SHA=<commit> bash benchmarks/device/quick_ab.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
T=${THREADS:-15}; LAYERS=${LAYERS:-24}
M=/tmp/qwen3-30b-a3b-${LAYERS}l.gguf
python3 benchmarks/gather_gemv.py --formats q8_0,q8_0x8 --out "$OUT" --label layout-$GPU \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^ "
python3 benchmarks/cpu_warm.py --threads $T --reps 20 --label $GPU-${T}t --out "$OUT" \
  --git-sha "${GIT_SHA:-}" 2>&1 | tail -2
[ -f $M ] || (python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers $LAYERS \
  --expert-format q8_0 --device cuda --out $M > /tmp/synth.log 2>&1) &
WRITE=$!
timeout ${TESTS_S:-120} python3 -m pytest -m cuda -q -p no:cacheprovider -rfE \
  tests/moe/test_cpu_warm.py tests/moe/test_layer_call.py tests/layers/test_block_linear.py \
  tests/moe/test_resident_blocks.py tests/kernels/test_gather_gemv.py > "$OUT/cuda_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -20
wait $WRITE || { tail -5 /tmp/synth.log; exit 1; }
python3 benchmarks/decode_moe.py --model $M --device cuda --temperature ${TEMPERATURE:-1} \
  --strategies ${STRATEGIES:-cpu,cpu+warm,resident,resident+regrouped} --moe-cache-mem 4GB \
  --moe-cpu-threads $T --tokens 64 --repeats 2 --label qwen3-30b-a3b-${LAYERS}l-ab-$GPU \
  --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 \
  | grep -E '"(strategy|decode_tokens_per_s|us_per_cpu_job|us_per_host_step|warm_used_rate)"|rror'
