#!/usr/bin/env bash
# GPU machine: a small-core box emulated: per row of ROWS ("CORES:ISA[:THREADS]", default
# "4:avx2"), the process limited to CORES cores (taskset), the CPU kernels capped at ISA
# ("native": no cap), THREADS pool workers (default CORES - 1); offload, hybrid (online) and
# auto (STRATEGIES) on the LAYERS-layer default-router q8_0 qwen3-30b-a3b file with a CACHE
# expert cache at temperature 1, ROUNDS interleaved rounds (default 3); one JSON in $OUT.
# PRESET and FORMAT pick another file (FORMAT: q8_0 for qwen3-30b-a3b, else the preset's
# own); ROWS="16:native:15" is the whole 16-core box, each strategy in its own process.
# BENCH_BW=1: each row first measures its own `ft bench bw --model` row, which its auto reads;
# DECODE_CHECK=1 adds its decode check (offload and the recommended strategy decode the model:
# auto offloads where offload was faster). PROFILE=path keeps that profile there (a later call
# without BENCH_BW reads it).
# Each run takes about 40 s (load, warm-up, 2 x 64 tokens): rows x rounds x strategies of them.
# Run as: GIT_SHA=<commit> bash benchmarks/device/small_box.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
LAYERS=${LAYERS:-12}; PRESET=${PRESET:-qwen3-30b-a3b}
[ "$PRESET" = qwen3-30b-a3b ] && FORMAT=${FORMAT:-q8_0}  # the file; others: their own
M=/tmp/$PRESET-${LAYERS}l.gguf  # the name peer_gpu.sh gives it: one file for both scripts
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET --layers $LAYERS \
  ${FORMAT:+--expert-format $FORMAT} --device cuda --out $M 2>&1 | tail -1
# each strategy in its own process, ROUNDS interleaved rounds, medians and ratios to offload in
# one JSON (benchmarks/small_box.py)
python3 benchmarks/small_box.py --model $M --device cuda --rows "$(echo ${ROWS:-4:avx2} | tr ' ' ,)" \
  --strategies ${STRATEGIES:-offload,hybrid-online,auto} --rounds ${ROUNDS:-3} \
  --moe-cache-mem ${CACHE:-4GB} --tokens 64 --repeats 2 \
  ${BENCH_BW:+--bench-bw} ${DECODE_CHECK:+--decode-check} ${PROFILE:+--profile $PROFILE} \
  --label $PRESET-${LAYERS}l-$GPU --out "$OUT" \
  --git-sha "${GIT_SHA:-}"
