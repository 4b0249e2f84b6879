#!/usr/bin/env bash
# GPU check of kernel v6e (the LLVM-assertion workaround and the tie fix): the bench sweep alone, then the GPU
# tests (4 shards), validate --suite full and replays of the bundled traces in parallel.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_lib.sh"
versions
COLUMNS=130 run bench 200 python3 -m routetool bench --tokens 1,64,4096,16384,65536 --experts 128,256,384,512 \
  --dtype fp32,bf16 --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench.csv" --json "$R/bench.json" --no-progress
pytest_shards pytest-gpu 260 4 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 260 &
validate_rest_and_replays 150 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
