#!/usr/bin/env bash
# Closing GPU session for kernel v6: the bench sweep alone, then correctness in parallel
# (GPU tests, validate --suite full, replays of the bundled traces) alongside the
# torch.compile baseline (its numbers are taken while the tests run; see results/README.md).
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_lib.sh"
versions
bench_sweep 190
run pytest-gpu 280 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel.py &
validate_shapes 280 &
validate_rest_and_replays 120 &
COLUMNS=130 run bench-compile 270 python3 -m routetool bench --tokens 64,65536 --experts 256 --dtype fp32 \
  --kernel torch-compile --kernel torch --kernel tiled --baseline torch --rep-ms 8 --csv "$R/bench-compile.csv" \
  --no-progress &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
