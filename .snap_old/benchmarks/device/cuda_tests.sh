#!/usr/bin/env bash
# GPU machine: every test with the `cuda` marker (offload bit for bit against resident, graph
# pieces, hybrid within tolerance, the fused kernels against gguf's dequantisation), after the
# CPU library is built there. TESTS narrows it (default: the whole tests/ tree).
# Run as: GIT_SHA=<commit> bash benchmarks/device/cuda_tests.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
build_cpu_library
# The embedded Gemma-3 package is too large to carry there: its tests are left out.
python3 -m pytest -m cuda -q -p no:cacheprovider -rfE ${TESTS:-tests} \
  --deselect tests/engine/test_moeified_gemma.py > "$OUT/cuda_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -40
