#!/usr/bin/env bash
# GPU machine, one short call: the changes a GPU has not settled yet, each against what runs
# today, in the order that needs the least device time first:
#   1. the CUDA tests of those changes (TESTS, TESTS_S seconds at most), while the files are
#      written;
#   2. decode on a LAYERS-layer q8_0 qwen3-30b-a3b file (default 48, the issue's file):
#      STRATEGIES (default `hybrid-profile`, `hybrid-profile+early`: the next piece launched
#      before look-ahead's plan, the same two online, and online without look-ahead);
#   3. with G4_STRATEGIES set, decode on a G4_LAYERS-layer gemma4-26b-a4b file (default 10).
# 4 GB cache, temperature 1, THREADS threads, TOKENS tokens (default 128).
# No llama.cpp here: the ratios are ours against ours.
# Run as: GIT_SHA=<commit> bash benchmarks/device/quick_ab.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
T=${THREADS:-15}; LAYERS=${LAYERS:-48}; G4_LAYERS=${G4_LAYERS:-10}
M=/tmp/qwen3-30b-a3b-${LAYERS}l.gguf
G4=/tmp/gemma4-26b-a4b-${G4_LAYERS}l-${GIT_SHA:-new}.gguf
( [ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers $LAYERS \
    --expert-format q8_0 --device cuda --out $M
  [ -z "${G4_STRATEGIES:-}" ] || [ -f $G4 ] || python3 -m freetoken.cli synth \
    --preset gemma4-26b-a4b --layers $G4_LAYERS --device cuda --out $G4 ) > /tmp/synth.log 2>&1 &
WRITE=$!
timeout ${TESTS_S:-240} python3 -m pytest -m cuda -q -p no:cacheprovider -rfE \
  ${TESTS:-tests/moe/test_offload.py tests/moe/test_graph_flags.py} > "$OUT/cuda_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -20
wait $WRITE || { tail -5 /tmp/synth.log; exit 1; }
S=hybrid-profile,hybrid-profile+early,hybrid-online,hybrid-online+early,hybrid-online+nolookahead
PAIRS=("$M:${STRATEGIES:-$S}:qwen3-30b-a3b-${LAYERS}l")
[ -n "${G4_STRATEGIES:-}" ] && PAIRS+=("$G4:$G4_STRATEGIES:gemma4-26b-a4b-${G4_LAYERS}l")
for pair in "${PAIRS[@]}"; do
  IFS=: read -r file strategies label <<< "$pair"
  python3 benchmarks/decode_moe.py --model $file --device cuda --temperature ${TEMPERATURE:-1} \
    --strategies $strategies --moe-cache-mem 4GB --moe-cpu-threads $T --tokens ${TOKENS:-128} \
    --repeats 2 --label $label-ab-$GPU --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 \
    | grep -E '"(strategy|decode_tokens_per_s|hit_rate|lookahead_hit_rate|us_per_host_step)"|rror'
done
