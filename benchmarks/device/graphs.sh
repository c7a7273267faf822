#!/usr/bin/env bash
# GPU machine: offload and hybrid decode through CUDA graph pieces (the experts eager between
# them): CUDA tests, then benchmarks/decode_moe.py on the gemma4-26b-a4b geometry (resident,
# offload, hybrid from the profile, hybrid corrected online; profile rows from the earlier
# `ft bench bw` run, benchmarks/results/benchbw-gemma4-qwen3-h200.json) and offload on the
# 48-layer qwen3-30b-a3b q8_0 preset, all with a 4 GB expert cache.
# Run as: GIT_SHA=<commit> bash benchmarks/device/graphs.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
cp benchmarks/results/benchbw-gemma4-qwen3-h200.json /tmp/benchbw.json
export FREETOKEN_BENCHBW_PATH=/tmp/benchbw.json
build_cpu_library
python3 -m pytest -m cuda -q -p no:cacheprovider tests/moe/test_offload.py tests/moe/test_hybrid.py \
  tests/engine 2>&1 | tail -4 | tee "$OUT/cuda_tests.log"
KEYS='"(strategy|decode_tokens_per_s|hit_rate|pcie_roofline_tokens_per_s|hybrid_roofline_tokens_per_s|fraction_of_roofline|fraction_of_hybrid_roofline|share_fetch|share_expert_compute|share_cpu_wait)"|Error|error'
M=/tmp/gemma4-26b-a4b-geometry.gguf
python3 -m freetoken.cli synth --preset gemma4-26b-a4b --device cuda --router-skew 1 \
  --router-locality 0.5 --out $M 2>&1 | tail -1
python3 benchmarks/decode_moe.py --model $M --device cuda \
  --strategies resident,offload,hybrid-profile,hybrid-online --moe-cache-mem 4GB \
  --tokens 64 --repeats 2 --label gemma4-26b-a4b-geometry-graphs-h200 --out "$OUT" \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" | tee "$OUT/decode_gemma4.log" | grep -E "$KEYS"
rm -f $M
M=/tmp/qwen3-30b-a3b-q8_0.gguf
python3 -m freetoken.cli synth --preset qwen3-30b-a3b --expert-format q8_0 --device cuda \
  --router-skew 1 --router-locality 0.5 --out $M 2>&1 | tail -1
python3 benchmarks/decode_moe.py --model $M --device cuda --strategies offload \
  --moe-cache-mem 4GB --tokens 64 --repeats 2 --label qwen3-30b-a3b-q8_0-48l-graphs-h200 \
  --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" | tee "$OUT/decode_qwen3.log" \
  | grep -E "$KEYS"
