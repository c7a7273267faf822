#!/usr/bin/env bash
# GPU machine: CUDA tests, then `ft serve` on the synthetic qwen3-30b-a3b preset (resident bf16)
# with benchmarks/serve.py at concurrency 1, 4, 8 and benchmarks/generate.py at batch 1.
# Run as: GIT_SHA=<commit> bash benchmarks/device/resident_serve.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
M=/tmp/qwen3-30b-a3b-q8_0.gguf
python3 -m pytest -m cuda -q -p no:cacheprovider tests/quant tests/models tests/moe tests/engine 2>&1 | tail -5 | tee "$OUT/cuda_tests.log"
[ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --expert-format q8_0 \
  --device cuda --router-skew 1 --router-locality 0.5 --out $M 2>&1 | tail -1
for G in 0 16; do
python3 benchmarks/generate.py --model $M --device cuda --tokens 128 --repeats 3 \
  --cuda-graph-max-bs $G --label qwen3-30b-a3b-resident-bf16-graphs$G --out "$OUT" \
  --git-sha "${GIT_SHA:-}" 2>&1 | grep -E '^  "(decode_tokens_per_s|roofline_tokens_per_s)"'
done
python3 -m freetoken.cli serve --model $M --device cuda --port 1919 --kv-tokens 65536 \
  --max-running-requests 8 > "$OUT/serve.log" 2>&1 &
for i in $(seq 1 120); do curl -sf localhost:1919/health >/dev/null && break; sleep 1; done
python3 benchmarks/serve.py --url http://127.0.0.1:1919 --requests 2 --max-tokens 64 \
  --label qwen3-30b-a3b-resident-bf16-graphs-$GPU --out "$OUT" --git-sha "${GIT_SHA:-}" 2>&1 | tail -4
kill %1; wait
tail -5 "$OUT/serve.log"
