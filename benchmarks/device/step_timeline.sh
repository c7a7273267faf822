#!/usr/bin/env bash
# GPU machine: a decode step's critical path layer by layer (benchmarks/step_timeline.py) on the
# 48-layer qwen3-30b-a3b q8_0 file (default router), 4 GB cache, temperature 1, 15 threads.
# STRATEGIES (default hybrid), TOKENS (default 48), TESTS (a pytest path list run with -m cuda
# first, while the file is written; default none) and ENVS (space-separated VAR=value sets,
# one timeline each, ',' between assignments of one set; default the engine's defaults; snap:
# a carried .snap tree of commit SNAP_SHA, with this tree's script and library) vary it.
# Run as: GIT_SHA=<commit> bash benchmarks/device/step_timeline.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
M=/tmp/qwen3-30b-a3b-48l.gguf
[ -f $M ] || (python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers 48 \
  --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1) &
SYNTH=$!
if [ -n "${TESTS:-}" ]; then
  timeout ${TESTS_S:-300} python3 -m pytest -m cuda -q -p no:cacheprovider -rfE --durations=5 \
    $TESTS > "$OUT/cuda_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log" | tail -30
fi
wait $SYNTH
# a carried .snap (an earlier commit's tree, SNAP_SHA) is timed too, with this tree's script
if [ -d .snap ]; then
  cp benchmarks/step_timeline.py .snap/benchmarks/ && cp freetoken/libfreetoken_cpu.so .snap/freetoken/
fi
for s in ${STRATEGIES:-hybrid}; do
  for e in ${ENVS:-default}; do
    vars=(); [ "$e" = default ] || IFS=, read -ra vars <<< "$e"
    tree=.; sha=${GIT_SHA:-}; [ "$e" = snap ] && { tree=.snap; sha=${SNAP_SHA:-snap}; vars=(); }
    (cd $tree && env "${vars[@]}" python3 benchmarks/step_timeline.py --model $M --strategy $s \
      --tokens ${TOKENS:-48} --moe-cpu-threads 15 --label "${e//[=,]/_}-$GPU" \
      --out "$OUT" --git-sha "$sha" 2>&1 | grep -v "^Loading\|it/s\]" | tail -45)
  done
done
