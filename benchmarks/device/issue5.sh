#!/usr/bin/env bash
# GPU machine: offload CUDA tests, then benchmarks/decode_moe.py (resident vs offload with a 4 GB
# expert cache) on the synthetic qwen3-30b-a3b preset in q8_0 and in bf16, skewed local routing.
# Run as: GIT_SHA=<commit> bash benchmarks/device/issue5.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
python3 -m pytest -m cuda -q -p no:cacheprovider tests/moe/test_offload.py tests/moe/test_resident.py \
  2>&1 | tail -3 | tee "$OUT/cuda_tests.log"
for FMT in q8_0 bf16; do
  M=/tmp/qwen3-30b-a3b-$FMT.gguf
  LAYERS=48
  # the bf16 file is ~60 GB: on a small disk keep half the layers (recorded in the label)
  [ "$FMT" = bf16 ] && [ "$(df --output=avail -B1G /tmp | tail -1)" -lt 66 ] && LAYERS=24
  python3 -m freetoken.cli synth --preset qwen3-30b-a3b --expert-format $FMT --layers $LAYERS \
    --device cuda --router-skew 1 --router-locality 0.5 --out $M 2>&1 | tail -1
  python3 benchmarks/decode_moe.py --model $M --device cuda --strategies resident,offload \
    --moe-cache-mem 4GB --tokens 64 --repeats 2 --label qwen3-30b-a3b-$FMT-${LAYERS}l-h200 \
    --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | grep -v "^Loading" | tee -a "$OUT/decode_$FMT.log" \
    | grep -E '"(strategy|decode_tokens_per_s|hit_rate|miss_bytes_per_token|gather_bytes_per_s|pcie_roofline_tokens_per_s|fraction_of_roofline|share_fetch|share_expert_compute)"|Error|error'
  rm -f $M
done
