#!/usr/bin/env bash
# GPU machine: ours against llama.cpp on one synthetic file in one run. Builds llama-bench from
# .peer/llama.cpp (a copy of ../shared/peers, carried; about 5 minutes, in the background while
# the file is written), then llama-bench's placements (-ncmoe NCMOE, -ot exps=CPU, all on the
# GPU; tg64, -r 2, THREADS threads) and benchmarks/decode_moe.py at TEMPERATURE (default 1, what
# chat clients send) for STRATEGIES with a CACHE expert cache, and merges both into
# peer_gpu-*.json (benchmarks/peer_gpu.py). PRESET, LAYERS (default 48: the whole model) and
# FORMAT pick the file (FORMAT: q8_0 for qwen3-30b-a3b, else the preset's own); the default
# router is token-specific with no skew (ROUTER adds flags; such a file is named apart).
# TOKENS (default 64, llama-bench's tg64) and WARMUP (default 16) set our runs' lengths.
# PREFILL=512,4096 also times our prefill at those prompt lengths (PREFILL_STRATEGIES: whose).
# WHILE_BUILDING runs a command during the build (the CUDA tests, say); nothing is timed until
# the build is done, so the compiler does not share the cores with a measurement.
# BENCH_BW=1 first measures the file's layer kind with `ft bench bw --model` on this box, so
# that auto decides from the box's own row rather than the carried H200 profile's nearest one.
# PARTS=peer or PARTS=ours runs one half (default both): a run too long for one call runs the
# peer first, then ours in a second call on the still-warm machine, which finds the file and
# llama-bench's JSON in /tmp and merges both. The peer half also brings back llama-bench's three
# JSON files (in llama-PRESET-LAYERSl/); where the machine was given back in between,
# LLAMA_FROM (a carried folder of them) seeds the second call with them; the merged JSON says
# whether both ran on one machine (same_machine, from the GPUs' UUIDs).
# Run as: GIT_SHA=<commit> bash benchmarks/device/peer_gpu.sh (carry .whl and .peer).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
moe_bench_setup
PARTS=${PARTS:-peer,ours}
BUILD=
if [[ $PARTS == *peer* ]]; then
  (bash .peer/build-llama-bench.sh .peer/llama.cpp > /tmp/llama-build.log 2>&1) &
  BUILD=$!
fi
PRESET=${PRESET:-qwen3-30b-a3b}; LAYERS=${LAYERS:-48}
# a file written with ROUTER flags is named apart from the default router's
RTAG=${ROUTER:+-r$(echo "$ROUTER" | md5sum | cut -c1-6)}
# llama-bench's files stay here, one folder per file, so several files can share one machine
L=/tmp/llama/$PRESET-${LAYERS}l$RTAG; mkdir -p $L
[ -n "${LLAMA_FROM:-}" ] && cp "$LLAMA_FROM"/{ncmoe,ot_cpu,gpu}.json "$LLAMA_FROM"/machine $L/
[ "$PRESET" = qwen3-30b-a3b ] && FORMAT=${FORMAT:-q8_0}  # the issue's file; others: their own
M=/tmp/$PRESET-${LAYERS}l$RTAG.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset $PRESET --layers $LAYERS \
  ${FORMAT:+--expert-format $FORMAT} --device cuda ${ROUTER:-} --out $M 2>&1 | tail -1
[ -n "${WHILE_BUILDING:-}" ] && bash -c "$WHILE_BUILDING"
[ -z "$BUILD" ] || wait $BUILD || { tail -20 /tmp/llama-build.log; exit 1; }
LABEL=$PRESET-${LAYERS}l$RTAG-${LABEL:-$GPU}  # a ROUTER file's results named apart too
if [[ -n "${BENCH_BW:-}" && $PARTS == *ours* ]]; then
  python3 -m freetoken.cli bench bw --model $M --device cuda --threads ${THREADS:-15} 2>&1 \
    | grep -v "it/s\]" | tail -3
  cp "$FREETOKEN_BENCHBW_PATH" "$OUT/benchbw-$LABEL.json"
fi
[[ $PARTS == *ours* ]] && python3 benchmarks/decode_moe.py --model $M --device cuda --temperature ${TEMPERATURE:-1} \
  --strategies ${STRATEGIES:-resident,offload,hybrid-online,cpu} --moe-cache-mem ${CACHE:-4GB} \
  --moe-cpu-threads ${THREADS:-15} --tokens ${TOKENS:-64} --warmup-tokens ${WARMUP:-16} \
  --repeats 2 --label $LABEL --out "$OUT" \
  --prefill-tokens "${PREFILL:-}" ${PREFILL_STRATEGIES:+--prefill-strategies $PREFILL_STRATEGIES} \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" \
  | grep -E '"(strategy|decode_tokens_per_s|hit_rate|lookahead_hit_rate|[0-9]+)"|rror|MoE plan'
LB=${LCB:-/tmp/lcb}/bin/llama-bench
T=${THREADS:-15}
for placement in "ncmoe=-ncmoe ${NCMOE:-42}" "ot_cpu=-ot exps=CPU" "gpu="; do
  [[ $PARTS == *peer* ]] || break
  name=${placement%%=*}; flags=${placement#*=}
  $LB -m $M -p 0 -n 64 -r 2 -ngl 99 -t $T $flags -o json > $L/$name.json 2> $L/$name.err \
    || tail -5 $L/$name.err
done
MACHINE=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -1)
[[ $PARTS == *peer* ]] && echo "$MACHINE" > $L/machine \
  && mkdir -p "$OUT/llama-$PRESET-${LAYERS}l$RTAG" \
  && cp $L/{ncmoe,ot_cpu,gpu}.json $L/machine "$OUT/llama-$PRESET-${LAYERS}l$RTAG/" 2>/dev/null
[[ $PARTS == *ours* ]] || exit 0
# ours alone on a machine that has not run llama.cpp's half: nothing to merge with
[ -f $L/gpu.json ] || { echo "no llama-bench results in $L: ours only"; exit 0; }
python3 benchmarks/peer_gpu.py --llama ncmoe=$L/ncmoe.json ot_cpu=$L/ot_cpu.json gpu=$L/gpu.json \
  --ours "$(ls -t "$OUT"/decode_moe-$LABEL-*.json | head -1)" \
  --model $M --label $LABEL --out "$OUT" --git-sha "${GIT_SHA:-}" \
  --llama-machine "$(cat $L/machine 2>/dev/null)" --machine "$MACHINE"
