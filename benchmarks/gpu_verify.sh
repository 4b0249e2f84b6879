#!/usr/bin/env bash
# GPU checks of the current tree (no timing): the GPU tests (6 shards), validate --suite full and replays of the
# bundled traces, all in parallel (compiling is CPU-bound). Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/gpu_lib.sh"
versions
pytest_shards pytest-gpu 420 6 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 450 &
validate_rest_and_replays 200 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
tail -n 2 "$R/validate-full-tiled-shapes.txt" "$R/validate-full-tiled-rest.txt"
for f in "$R"/replay-*.txt; do tail -n 3 "$f"; done
