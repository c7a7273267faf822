#!/usr/bin/env bash
# GPU machine: benchmarks/decode_moe.py, each MoE strategy's decode with a 4 GB expert cache
# next to resident in the same run (link rooflines and serial ceilings), on a synthetic
# checkpoint of PRESET (gemma4-26b-a4b, or qwen3-30b-a3b written in q8_0), after the MoE CUDA
# tests. STRATEGIES (resident, offload, offload-eager, hybrid-cap1, hybrid-profile,
# hybrid-online, cpu), SPIN (--moe-cpu-spin-us), REPEATS and TESTS=0 (skip the tests) vary it;
# LABEL names the result. The profile rows in use are benchmarks/results/benchbw-gemma4-qwen3-h200.json.
# Run as: GIT_SHA=<commit> bash benchmarks/device/decode_moe.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -m cuda -q -p no:cacheprovider tests/moe tests/engine/test_scheduler.py \
  2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20 | tee "$OUT/cuda_tests.log"
KEYS='"(strategy|decode_tokens_per_s|hit_rate|pcie_roofline_tokens_per_s|hybrid_roofline_tokens_per_s|fraction_of_roofline|fraction_of_hybrid_roofline|share_fetch|share_plan|share_cpu_wait)"|error|ceiling'
PRESET=${PRESET:-gemma4-26b-a4b}  # qwen3-30b-a3b: written in q8_0
M=/tmp/$PRESET.gguf
FORMAT=(); [ "$PRESET" = qwen3-30b-a3b ] && FORMAT=(--expert-format q8_0)
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET "${FORMAT[@]}" --device cuda \
  --router-skew 1 --router-locality 0.5 --out $M 2>&1 | tail -1
python3 benchmarks/decode_moe.py --model $M --device cuda \
  --strategies ${STRATEGIES:-resident,offload,hybrid-online,hybrid-profile,cpu} \
  --moe-cache-mem 4GB --moe-cpu-spin-us ${SPIN:-1000} --tokens 64 --repeats ${REPEATS:-2} \
  --label $PRESET-${LABEL:-tables}-$GPU \
  --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" \
  | tee "$OUT/decode_${LABEL:-tables}.log" | grep -E "$KEYS"
