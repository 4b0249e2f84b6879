#!/usr/bin/env bash
# GPU session for the two-level kernel with the redo in registers: the GPU tests of the
# two-level launches (one and several warps per program, register limits), then a sweep of
# warps per program x programs per SM x register limits at 65536 tokens.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_lib.sh"
versions
run pytest-two-level 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel.py -k two_level
LAUNCHES=${LAUNCHES:-1:28:0,1:32:0,2:16:0,2:18:56,2:21:48,4:8:0,4:9:56,4:10:48,4:12:40}
run tune-multiwarp 380 python3 benchmarks/tune_tiled.py --two-level --tokens 65536 \
  --experts 256:fp32,256:bf16,384:fp32,512:fp32 --launches "$LAUNCHES" --budget-s 340 --out "$R/tune-multiwarp.csv"
cat "$S"
