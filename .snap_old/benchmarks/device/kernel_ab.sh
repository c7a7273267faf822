#!/usr/bin/env bash
# GPU machine's CPU: benchmarks/cpu_moe.py at 15 workers on two builds of the CPU library in
# one run, alternating ROUNDS times, so a kernel change is compared on the same host (hosts
# differ by ~10 points between runs). "new" is this tree; "base" is a copy of it with the csrc
# files in AB_DIR (default .peer/ab, carried) laid over its csrc/. The kernel tests run on "new"
# first. Results go to $OUT/new and $OUT/base.
# Run as: GIT_SHA=<commit> BASE_SHA=<commit> bash benchmarks/device/kernel_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/new" "$OUT/base"
source benchmarks/device/setup.sh
lscpu | grep -E "Model name|^CPU\(s\)|L3|Flags" | cut -c1-400 > "$OUT/cpu.txt"
build_cpu_library
BASE=/tmp/base; rm -rf $BASE; mkdir -p $BASE
cp -r benchmarks freetoken csrc CMakeLists.txt pyproject.toml $BASE/
cp ${AB_DIR:-.peer/ab}/* $BASE/csrc/
(cd $BASE && cmake -S . -B /tmp/build_base -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/build_base.log" 2>&1 \
  && cmake --build /tmp/build_base >> "$OUT/build_base.log" 2>&1 \
  && cp /tmp/build_base/libfreetoken_cpu.so freetoken/) || { tail -20 "$OUT/build_base.log"; exit 1; }
[ "${TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider tests/cpu/test_kernels.py \
  tests/layers/test_pool_linear.py 2>&1 | tail -2 | tee "$OUT/cpu_tests.log"
for round in $(seq ${ROUNDS:-2}); do
  for side in base new; do
    dir=$PWD; sha=${GIT_SHA:-}
    [ $side = base ] && { dir=$BASE; sha=${BASE_SHA:-}; }
    echo "== round $round: $side"
    (cd $dir && GIT_SHA=$sha FREETOKEN_GIT_SHA=$sha python3 benchmarks/cpu_moe.py \
      --fmt ${FMTS:-bf16,q8_0} --threads 15 --batch ${BATCH:-1,4} --down-split experts \
      ${CPU_MOE_ARGS:-} --out "$OUT/$side" 2>&1 | grep -E "GB/s|paired")
  done
done
