# Sourced by the GPU scripts: carried wheels on the path, the bench environment, and the CPU
# MoE library built there (Python 3.12 / g++ 13). Expects OUT and, for copied trees, GIT_SHA.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FREETOKEN_CACHE_DIR=/tmp/ftcache
export FREETOKEN_GIT_SHA=${GIT_SHA:-}
# the card in result labels (h200, h100): the machine a call gets is not always the one named
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
  | grep -o 'H[0-9]\+' | tr 'H' 'h'); GPU=${GPU:-gpu}
# The H200's bandwidth profile (gemma4 and qwen3 rows) in use, and the CPU library built once.
moe_bench_setup() {
  cp benchmarks/results/benchbw-gemma4-qwen3-h200.json /tmp/benchbw.json
  export FREETOKEN_BENCHBW_PATH=/tmp/benchbw.json
  [ -f freetoken/libfreetoken_cpu.so ] || build_cpu_library
}
build_cpu_library() {
  cmake -S . -B /tmp/build -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
    && cmake --build /tmp/build >> "$OUT/build.log" 2>&1 \
    && cp /tmp/build/libfreetoken_cpu.so freetoken/ || { tail -20 "$OUT/build.log"; exit 1; }
}
