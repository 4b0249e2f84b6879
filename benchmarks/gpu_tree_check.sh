#!/usr/bin/env bash
# GPU checks of a tree whose kernel already passed benchmarks/gpu_verify.sh, after changes outside the kernel
# (e.g. the tie-aware comparison the GPU tests and validate use): the tests marked gpu in 4 parallel shards,
# validate --suite full without its shapes family, and replays of the bundled traces.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/gpu_lib.sh"
versions
pytest_shards pytest-gpu 330 4 -m gpu tests &
validate_rest_and_replays 200 &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
tail -n 2 "$R/validate-full-tiled-rest.txt"
for f in "$R"/replay-*.txt; do tail -n 1 "$f"; done
