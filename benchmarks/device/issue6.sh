#!/usr/bin/env bash
# GPU machine: build the CPU MoE library, run the MoE CUDA tests, `ft bench bw` on the
# gemma4-26b-a4b geometry (29 q8_0 + 1 bf16 expert layers) and the qwen3-30b-a3b preset, then
# benchmarks/decode_moe.py on the gemma4 geometry with a 4 GB expert cache: offload, the hybrid
# variants (cap 1, profile, online) and cpu.
# Run as: GIT_SHA=<commit> bash benchmarks/device/issue6.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
export FREETOKEN_BENCHBW_PATH=$OUT/benchbw.json
build_cpu_library
python3 -m pytest -m cuda -q -p no:cacheprovider tests/moe 2>&1 | tail -3 | tee "$OUT/cuda_tests.log"
M=/tmp/gemma4-26b-a4b-geometry.gguf
python3 -m freetoken.cli synth --preset gemma4-26b-a4b --device cuda --router-skew 1 \
  --router-locality 0.5 --out $M 2>&1 | tail -1
python3 -m freetoken.cli bench bw --model $M --preset qwen3-30b-a3b --device cuda 2>&1 \
  | grep -v "it/s\]" | tail -8 | tee "$OUT/benchbw.log"
python3 benchmarks/decode_moe.py --model $M --device cuda \
  --strategies offload,hybrid-cap1,hybrid-profile,hybrid-online,cpu --moe-cache-mem 4GB \
  --tokens 64 --repeats 2 --label gemma4-26b-a4b-geometry-h200 --out "$OUT" \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" | tee "$OUT/decode.log" \
  | grep -E '"(strategy|decode_tokens_per_s|hit_rate|pcie_roofline_tokens_per_s|hybrid_roofline_tokens_per_s|fraction_of_roofline|fraction_of_hybrid_roofline|share_fetch|share_expert_compute|share_cpu_wait)"|Error|error|plan'
