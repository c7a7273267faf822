#!/usr/bin/env bash
# GPU machine: CUDA parity tests, then the synthetic qwen3-30b-a3b preset fully resident in bf16.
# Run as: GIT_SHA=<commit> bash benchmarks/device/issue2.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FREETOKEN_CACHE_DIR=/tmp/ftcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log"
t=$(date +%s)
python3 -m freetoken.cli synth --preset qwen3-30b-a3b --expert-format q8_0 --device cuda \
  --out /tmp/qwen3-30b-a3b-q8_0.gguf 2>&1 | tail -3 | tee "$OUT/synth.log"
echo "synth took $(( $(date +%s) - t )) s" | tee -a "$OUT/synth.log"
python3 -m freetoken.cli generate --model /tmp/qwen3-30b-a3b-q8_0.gguf --device cuda \
  --max-tokens 32 --prompt "hello world" 2>&1 | tail -4 | tee "$OUT/generate.log"
python3 benchmarks/generate.py --model /tmp/qwen3-30b-a3b-q8_0.gguf --device cuda \
  --tokens 128 --repeats 3 --label qwen3-30b-a3b-resident-bf16 --out "$OUT" 2>&1 | tail -30
