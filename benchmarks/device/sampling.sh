#!/usr/bin/env bash
# GPU machine: what sampling costs. The sampler's CUDA tests; benchmarks/sample.py (one token's
# draw on the GPU against the host multinomial it replaced); then benchmarks/decode_moe.py on a
# synthetic PRESET file of LAYERS layers (default router) at temperature 0 and at 1, each
# STRATEGY with a CACHE expert cache (hybrid's split at temperature 0 too: +greedysplit; the
# engine's default fetches every miss for a greedy request).
# Run as: GIT_SHA=<commit> bash benchmarks/device/sampling.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
python3 -m pytest -m cuda -q -p no:cacheprovider tests/engine/test_sample.py 2>&1 | tail -2 \
  | tee "$OUT/cuda_tests.log"
python3 benchmarks/sample.py --device cuda --label $GPU --out "$OUT" --git-sha "${GIT_SHA:-}"
PRESET=${PRESET:-qwen3-30b-a3b}
M=/tmp/$PRESET-${LAYERS:-12}l.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET --layers ${LAYERS:-12} \
  --expert-format ${FORMAT:-q8_0} --device cuda --out $M 2>&1 | tail -1
for T in 0 1; do
  python3 benchmarks/decode_moe.py --model $M --device cuda --temperature $T \
    --strategies ${STRATEGIES:-resident,offload,hybrid-online+greedysplit} \
    --moe-cache-mem ${CACHE:-1GB} --tokens 64 --repeats 2 --label $PRESET-${LAYERS:-12}l-t$T-$GPU --out "$OUT" \
    --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" | grep -E '"(strategy|decode_tokens_per_s|hit_rate)"|rror'
done
