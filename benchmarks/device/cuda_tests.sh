#!/usr/bin/env bash
# GPU machine: every test with the `cuda` marker (offload bit for bit against resident, graph
# pieces, hybrid within tolerance, the fused kernels against gguf's dequantisation), after the
# CPU library is built there. TESTS narrows it (default: the whole tests/ tree).
# Run as: GIT_SHA=<commit> bash benchmarks/device/cuda_tests.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
build_cpu_library
python3 -m pytest -m cuda -q -p no:cacheprovider ${TESTS:-tests} 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed|skipped" | head -40 | tee "$OUT/cuda_tests.log"
