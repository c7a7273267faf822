#!/usr/bin/env bash
# GPU machine's CPU: build the CPU MoE library, run its tests there, then benchmarks/cpu_moe.py
# at 15 workers (one core left for the engine thread).
# Run as: GIT_SHA=<commit> bash benchmarks/device/issue4.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
lscpu | grep -E "Model name|^CPU\(s\)|L3" | tee "$OUT/cpu.txt"
cmake -S . -B /tmp/build -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
  && cmake --build /tmp/build >> "$OUT/build.log" 2>&1 \
  && cp /tmp/build/libfreetoken_cpu.so freetoken/ || { tail -20 "$OUT/build.log"; exit 1; }
python3 -m pytest -q -p no:cacheprovider tests/moe 2>&1 | tail -3 | tee "$OUT/cpu_tests.log"
python3 benchmarks/cpu_moe.py --fmt bf16,q8_0 --threads 15 --batch 1,2,3,4 --out "$OUT" 2>&1 \
  | tail -15
