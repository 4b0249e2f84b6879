#!/usr/bin/env bash
# GPU checks of the current tree (no timing): the GPU tests (6 shards), validate --suite full and replays of the
# bundled traces, all in parallel (compiling is CPU-bound). Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/gpu_lib.sh"
versions
verify_tree
tar czf "$OUT/results.tgz" -C "$R" .
verify_summary
