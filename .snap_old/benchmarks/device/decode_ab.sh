#!/usr/bin/env bash
# GPU machine: benchmarks/decode_moe.py on two trees in one run, alternating ROUNDS times on
# the same synthetic file, so a change that should not move decode speed is checked on the
# same host. "new" is this tree; "base" is the tree in AB_DIR (default .peer/base, carried: a
# `git archive BASE_SHA freetoken csrc CMakeLists.txt pyproject.toml benchmarks` unpacked
# there). PRESET, LAYERS, FORMAT, STRATEGIES, CACHE and TEMPERATURE vary it. Results go to $OUT/new and
# $OUT/base.
# Run as: GIT_SHA=<commit> BASE_SHA=<commit> bash benchmarks/device/decode_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/new" "$OUT/base"
source benchmarks/device/setup.sh
moe_bench_setup
BASE=${AB_DIR:-.peer/base}
(cd $BASE && cmake -S . -B /tmp/build_base -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/build_base.log" 2>&1 \
  && cmake --build /tmp/build_base >> "$OUT/build_base.log" 2>&1 \
  && cp /tmp/build_base/libfreetoken_cpu.so freetoken/) || { tail -20 "$OUT/build_base.log"; exit 1; }
PRESET=${PRESET:-qwen3-30b-a3b}
M=/tmp/$PRESET-${LAYERS:-12}l.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET --layers ${LAYERS:-12} \
  --expert-format ${FORMAT:-q8_0} --device cuda --out $M 2>&1 | tail -1
KEYS='"(strategy|decode_tokens_per_s|hit_rate)"|rror'
for round in $(seq ${ROUNDS:-1}); do
  for side in base new; do
    dir=$PWD; sha=${GIT_SHA:-}
    [ $side = base ] && { dir=$BASE; sha=${BASE_SHA:-}; }
    echo "== round $round: $side"
    (cd $dir && PYTHONPATH=/tmp/site:$dir FREETOKEN_GIT_SHA=$sha python3 benchmarks/decode_moe.py \
      --model $M --device cuda --strategies ${STRATEGIES:-resident,offload,hybrid-online} \
      --moe-cache-mem ${CACHE:-1GB} --tokens 64 --repeats 2 --temperature ${TEMPERATURE:-0} --git-sha "$sha" \
      --label $PRESET-${LAYERS:-12}l-ab-$side-$GPU --out "$OUT/$side" 2>&1 \
      | grep -v "^Loading" | grep -E "$KEYS")
  done
done
