#!/usr/bin/env bash
# GPU session for kernel v6f (two tiles per persistent-loop iteration, in two register sets): the bench sweep
# alone, then the GPU tests (6 shards), validate --suite full and replays of the bundled traces in parallel.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/gpu_lib.sh"
versions
bench_sweep 150
grep "tiled.*65,536" "$R/bench.txt" >> "$S"
pytest_shards pytest-gpu 330 6 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 380 &
validate_rest_and_replays 150 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
tail -n 2 "$R/validate-full-tiled-shapes.txt" "$R/validate-full-tiled-rest.txt"
