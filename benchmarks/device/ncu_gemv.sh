#!/usr/bin/env bash
# GPU machine: Nsight Compute's reading of one layer's fused expert kernels (gate/up with the
# activation, then down; 8 pairs of SHAPE, FORMATS) as gather_gemv.py launches them: where the
# kernel's time goes (DRAM, L1, issue slots, stalls, occupancy). The report is saved as
# $OUT/ncu-gather_gemv-$GPU.txt. Nsight Compute locks the clocks, so its durations run longer
# than a graph's; read the shares, not the microseconds.
# Run as: GIT_SHA=<commit> bash benchmarks/device/ncu_gemv.sh (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/device/setup.sh
NCU=${NCU:-/usr/local/cuda/bin/ncu}
timeout ${LIMIT:-120} $NCU --kernel-name regex:gather_gemv --launch-skip 6 --launch-count 2 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section WarpStateStats --section LaunchStats --section SchedulerStats \
  python3 benchmarks/gather_gemv.py --shape ${SHAPE:-2048x768} --formats ${FORMATS:-q8_0} \
  --reps 3 --label ncu --out /tmp/ncu-bench > "$OUT/ncu-gather_gemv-$GPU.txt" 2>&1
grep -E "Duration|Throughput|Issued Warp|Eligible|Achieved Occupancy|Grid Size|Registers" \
  "$OUT/ncu-gather_gemv-$GPU.txt"
