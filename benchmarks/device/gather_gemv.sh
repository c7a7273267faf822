#!/usr/bin/env bash
# GPU machine: the fused gather-GEMV kernels compiled (their CUDA tests against gguf's
# dequantisation and the slow twin), then timed per format against a device-copy ceiling at the
# qwen3-30b-a3b, gemma4-26b-a4b and gpt-oss-20b expert shapes. SWEEP=1 instead times every
# launch choice of q8_0 (qwen3's shape) and mxfp4 (gpt-oss's) and leaves the fastest in
# /tmp/gemv_launch, as FREETOKEN_GEMV_LAUNCH reads them (a later call on the warm machine:
# `export FREETOKEN_GEMV_LAUNCH="$(cat /tmp/gemv_launch)"`).
# Run as: GIT_SHA=<commit> bash benchmarks/device/gather_gemv.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
python3 -m pytest -m cuda -q -p no:cacheprovider tests/kernels/test_gather_gemv.py \
  2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20 | tee "$OUT/kernel_tests.log"
if [ -n "${SWEEP:-}" ]; then
  : > /tmp/gemv_launch
  for row in "q8_0 2048x768 8" "mxfp4 2880x2880 4"; do
    set -- $row
    python3 benchmarks/gather_gemv.py --sweep --formats $1 --shape $2 --pairs $3 \
      --label $GPU-sweep-$2 --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | tee /tmp/sweep.log \
      | grep -v "^    rows"
    grep -o "FREETOKEN_GEMV_LAUNCH='[^']*'" /tmp/sweep.log | cut -d"'" -f2 >> /tmp/gemv_launch
  done
  echo "launch choices: $(cat /tmp/gemv_launch | tr '\n' ' ')"
  exit 0
fi
python3 benchmarks/gather_gemv.py --shape 2048x768 --label $GPU-2048x768 --out "$OUT" \
  --formats q8_0,q4_k/q4_k/q6_k,q5_0/q5_0/q8_0 --git-sha "${GIT_SHA:-}" 2>&1 | tail -4
python3 benchmarks/gather_gemv.py --shape 2816x704 --label $GPU-2816x704 --out "$OUT" \
  --formats q8_0,q5_0 --git-sha "${GIT_SHA:-}" 2>&1 | tail -3
python3 benchmarks/gather_gemv.py --shape 2880x2880 --pairs 4 --label $GPU-2880x2880 \
  --out "$OUT" --formats mxfp4,q8_0 --git-sha "${GIT_SHA:-}" 2>&1 | tail -3
