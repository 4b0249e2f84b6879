#!/usr/bin/env bash
# GPU check of kernel v6e (the LLVM-assertion workaround and the tie fix): the bench sweep alone, then the GPU
# tests (4 shards), validate --suite full and replays of the bundled traces in parallel.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_lib.sh"
versions
bench_sweep 200
pytest_shards pytest-gpu 260 4 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 260 &
validate_rest_and_replays 150 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
