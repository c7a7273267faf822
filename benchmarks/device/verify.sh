#!/usr/bin/env bash
# GPU machine: the CUDA tests of decode graph pieces (offload bitwise, hybrid within tolerance),
# the hybrid CUDA test and the fused dequantise on CUDA.
# Run as: GIT_SHA=<commit> bash benchmarks/device/verify.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
build_cpu_library
python3 -m pytest -m cuda -q -p no:cacheprovider tests/moe/test_offload.py tests/moe/test_hybrid.py \
  tests/quant/test_quant_registry.py 2>&1 | tail -25 | tee "$OUT/cuda_tests.log"
