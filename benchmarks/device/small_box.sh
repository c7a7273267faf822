#!/usr/bin/env bash
# GPU machine: the second seed's box emulated (issue 17): per row of ROWS ("CORES:ISA[:THREADS]",
# default "4:avx2"), the process limited to CORES cores (taskset), the CPU kernels capped at
# ISA ("native": no cap), THREADS pool workers (default CORES - 1); offload, hybrid (online)
# and auto (STRATEGIES) on the LAYERS-layer default-router q8_0 qwen3-30b-a3b file with a
# CACHE expert cache at temperature 1 (benchmarks/decode_moe.py, JSON in $OUT).
# Run as: GIT_SHA=<commit> bash benchmarks/device/small_box.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
LAYERS=${LAYERS:-12}
M=/tmp/qwen3-30b-a3b-${LAYERS}l.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers $LAYERS \
  --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1
for row in ${ROWS:-4:avx2}; do
  IFS=: read -r cores isa threads <<< "$row"
  threads=${threads:-$((cores - 1))}
  echo "== $cores cores, $isa, $threads threads"
  # one process per strategy: an engine built after another in the same process inherits
  # its threads' placement
  for s in $(echo ${STRATEGIES:-offload,hybrid-online,auto} | tr , ' '); do
    ( [ "$isa" = native ] || export FREETOKEN_CPU_ISA=$isa
      taskset -c 0-$((cores - 1)) python3 benchmarks/decode_moe.py \
        --model $M --device cuda --temperature 1 --strategies $s \
        --moe-cache-mem ${CACHE:-4GB} --moe-cpu-threads $threads --tokens 64 --repeats 2 \
        --label qwen3-30b-a3b-${LAYERS}l-h200-${cores}cores-$isa-t$threads-$s --out "$OUT" \
        --git-sha "${GIT_SHA:-}" 2>&1 \
        | grep -E '"(strategy|decode_tokens_per_s|hit_rate)"|rror|auto:|shrink' )
  done
done
