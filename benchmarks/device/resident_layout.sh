#!/usr/bin/env bash
# GPU machine: resident Q8_0 experts regrouped as Q8_0x8 against the file's blocks. One layer
# of the fused kernels (benchmarks/gather_gemv.py: q8_0 and q8_0x8 at 2048x768, then SWEEP=1
# times q8_0x8's launch choices of READERS (default int8_x) for at most SWEEP_S seconds,
# and the decode runs regrouped experts at the fastest), then decode on the 48-layer q8_0
# file (written here unless /tmp has it; PRESET, LAYERS) with `resident+fileblocks+densedequant`
# (the file's blocks, attention and head dequantised), `resident+regrouped+densedequant` and
# `resident+regrouped+denseblocks` (today's defaults) in one decode_moe.py run.
# Run as: GIT_SHA=<commit> bash benchmarks/device/resident_layout.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
PRESET=${PRESET:-qwen3-30b-a3b}; LAYERS=${LAYERS:-48}
M=/tmp/$PRESET-${LAYERS}l.gguf
[ -f $M ] || (python3 -m freetoken.cli synth --preset $PRESET --layers $LAYERS \
  --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1) &
WRITE=$!
python3 benchmarks/gather_gemv.py --formats q8_0,q8_0x8 --out "$OUT" --label layout-$GPU \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^ "
if [ -n "${SWEEP:-}" ]; then
  python3 benchmarks/gather_gemv.py --formats q8_0x8 --sweep --readers ${READERS:-int8_x} \
    --sweep-budget-s ${SWEEP_S:-150} --out "$OUT" --label sweep-$GPU --git-sha "${GIT_SHA:-}" \
    2>&1 | tail -8 | tee /tmp/sweep.txt
  # the decode below runs regrouped experts at the sweep's fastest choice
  best=$(grep -o "FREETOKEN_GEMV_LAUNCH='[^']*'" /tmp/sweep.txt | tail -1 | cut -d"'" -f2)
  [ -n "$best" ] && export FREETOKEN_GEMV_LAUNCH="$best" && echo "decode with $best"
fi
wait $WRITE
python3 benchmarks/decode_moe.py --model $M --device cuda --temperature ${TEMPERATURE:-1} \
  --strategies ${STRATEGIES:-resident+fileblocks+densedequant,resident+regrouped+densedequant,resident+regrouped+denseblocks} --tokens 64 --repeats 2 \
  --label $PRESET-${LAYERS}l-layout-$GPU --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 \
  | grep -E '"(strategy|decode_tokens_per_s)"|rror'
