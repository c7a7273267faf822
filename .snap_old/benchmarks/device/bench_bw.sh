#!/usr/bin/env bash
# GPU machine: `ft bench bw` (CPU and PCIe GB/s per MoE layer kind) on a synthetic checkpoint
# of PRESET (default gemma4-26b-a4b: 29 q8_0 + 1 bf16 expert layers), with the rows of
# EXTRA_PRESET (default qwen3-30b-a3b) beside it; the profile is saved in $OUT/benchbw.json.
# Run as: GIT_SHA=<commit> bash benchmarks/device/bench_bw.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
export FREETOKEN_BENCHBW_PATH=$OUT/benchbw.json
build_cpu_library
PRESET=${PRESET:-gemma4-26b-a4b}
M=/tmp/$PRESET.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET --device cuda --out $M 2>&1 | tail -1
python3 -m freetoken.cli bench bw --model $M --preset ${EXTRA_PRESET:-qwen3-30b-a3b} \
  --device cuda 2>&1 | grep -v "it/s\]" | tail -8 | tee "$OUT/benchbw.log"
