#!/usr/bin/env bash
# GPU machine: the fused gather-GEMV kernels compiled (their CUDA tests against gguf's
# dequantisation and the slow twin), then timed per format against a device-copy ceiling at the
# qwen3-30b-a3b and gemma4-26b-a4b expert shapes.
# Run as: GIT_SHA=<commit> bash benchmarks/device/gather_gemv.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
python3 -m pytest -m cuda -q -p no:cacheprovider tests/kernels/test_gather_gemv.py \
  2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | head -20 | tee "$OUT/kernel_tests.log"
python3 benchmarks/gather_gemv.py --shape 2048x768 --label $GPU-2048x768 --out "$OUT" \
  --formats q8_0,q4_k/q4_k/q6_k,q5_0/q5_0/q8_0 --git-sha "${GIT_SHA:-}" 2>&1 | tail -4
python3 benchmarks/gather_gemv.py --shape 2816x704 --label $GPU-2816x704 --out "$OUT" \
  --formats q8_0,q5_0 --git-sha "${GIT_SHA:-}" 2>&1 | tail -3
