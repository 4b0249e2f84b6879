#!/usr/bin/env bash
# GPU tests and validate's full shapes family on kernel v6e, with the time they need (gpu_v6e.sh gave them
# 260 s alongside each other: one test shard and the shapes family were still compiling kernels then).
set -u
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/gpu_lib.sh"
versions
pytest_shards pytest-gpu 440 6 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 460 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
tail -n 3 "$R/validate-full-tiled-shapes.txt"
