#!/usr/bin/env bash
# Nsight Compute profile of the two-level kernel (65536 x 256 fp32) and the scan kernel, for
# stall reasons and pipe use. Output: $OUT/ncu-*.txt
set -u
OUT=${OUT:-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats --section ComputeWorkloadAnalysis --section SourceCounters"
timeout 150 ncu --kernel-name regex:_two_level_kernel --launch-skip 3 --launch-count 1 $SECTIONS \
  python3 benchmarks/profile_kernel.py --algorithm two_level --dtype ${DTYPE:-fp32} > "$OUT/ncu-two-level.txt" 2>&1
echo "two-level: exit $?"
timeout 100 ncu --kernel-name regex:_routing_kernel --launch-skip 3 --launch-count 1 $SECTIONS \
  python3 benchmarks/profile_kernel.py --algorithm scan --block-t 8 --chunk 128 --warps 4 > "$OUT/ncu-scan.txt" 2>&1
echo "scan: exit $?"
