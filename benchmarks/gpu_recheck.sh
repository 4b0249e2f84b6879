#!/usr/bin/env bash
# GPU checks after changes outside the kernel (comparison, validate, bench's calls): everything
# gpu_verify.sh runs (the GPU tests in 6 shards, validate --suite full with its shapes family, replays),
# then the headline bench points (tiled vs seed at 64 and 65536 tokens, 256 experts, fp32 and bf16).
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_lib.sh"
versions
pytest_shards pytest-gpu 420 6 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
validate_shapes 450 &
validate_rest_and_replays 200 &
wait
COLUMNS=130 run bench-headline 150 python3 -m routetool bench --tokens 64,65536 --experts 256 --dtype fp32,bf16 \
  --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench-headline.csv" --no-progress
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
tail -n 2 "$R/validate-full-tiled-shapes.txt" "$R/validate-full-tiled-rest.txt"
for f in "$R"/replay-*.txt; do tail -n 1 "$f"; done
cat "$R/bench-headline.txt"
