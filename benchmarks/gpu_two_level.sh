#!/usr/bin/env bash
# GPU session for the two-level kernel: launch sweep (scan vs two-level by size), then the
# kernel tests on the GPU. Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_lib.sh"
run tune-two-level 380 python3 benchmarks/tune_tiled.py --two-level --budget-s 330 --out "$R/tune-two-level.csv"
run pytest-kernel 160 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernel.py tests/test_gpu.py
cat "$S"
