#!/usr/bin/env bash
# GPU machine's CPU: the CPU MoE library built there and its tests, then benchmarks/cpu_moe.py
# at 15 workers (one core left for the engine thread) with both down_proj splits and per-phase
# timing (TIMING=0 leaves it out: the decode path's one call per job; CPU_MOE_ARGS adds flags:
# a prefetch or item-size sweep, --pairs). PEER=1 then runs benchmarks/cpu_peer.py at 16
# threads against llama.cpp on a synthetic qwen3-30b-a3b GGUF of PEER_LAYERS (16) q8_0 layers;
# llama-cpp-python's package (and diskcache) are carried in .peer/site, since the machine has
# no index to install from: copy both package folders from a `pip install llama-cpp-python
# diskcache` here (the llama_cpp/lib/*.so and *.so.0 files, not the versioned duplicates; about
# 17 MB) and pass carry [".whl", ".peer"].
# Run as: GIT_SHA=<commit> bash benchmarks/device/cpu_moe.sh (the copied tree has no .git).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
lscpu | grep -E "Model name|^CPU\(s\)|L3|Flags" | cut -c1-400 > "$OUT/cpu.txt"
build_cpu_library
if [ "${BENCH:-1}" = 1 ]; then
  [ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/cpu/test_kernels.py \
    tests/cpu/test_executor.py tests/layers/test_pool_linear.py 2>&1 | tail -2 \
    | tee "$OUT/cpu_tests.log"
  python3 benchmarks/cpu_moe.py --fmt ${FMTS:-bf16,q8_0} --threads 15 --batch ${BATCH:-1,4} \
    --down-split ${SPLITS:-rows,experts} $([ "${TIMING:-1}" = 1 ] && echo --timing) \
    ${CPU_MOE_ARGS:-} --out "$OUT" 2>&1 \
    | grep -v "pool_us=" | tail -40
fi
if [ "${PEER:-0}" = 1 ]; then
  M=/tmp/qwen3-${PEER_LAYERS:-16}l-q8_0.gguf
  [ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers ${PEER_LAYERS:-16} \
    --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1
  PYTHONPATH=$PWD/.peer/site:$PYTHONPATH python3 benchmarks/cpu_peer.py --model $M --repeats ${REPEATS:-3} \
    --threads 16 --tokens 32 --engines ${ENGINES:-cpu_dense_pool} --label qwen3-${PEER_LAYERS:-16}layers-q8_0-16cores-$GPU \
    --out "$OUT" 2>&1 | grep -v output_ids | tail -${PEER_TAIL:-25}
fi
