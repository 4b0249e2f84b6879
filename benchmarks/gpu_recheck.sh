#!/usr/bin/env bash
# GPU checks after changes outside the kernel (comparison, validate, bench's calls): everything
# gpu_verify.sh runs (verify_tree), then the headline bench points (tiled vs seed at 64 and 65536 tokens,
# 256 experts, fp32 and bf16). Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_lib.sh"
versions
verify_tree
COLUMNS=130 run bench-headline 150 python3 -m routetool bench --tokens 64,65536 --experts 256 --dtype fp32,bf16 \
  --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench-headline.csv" --no-progress
tar czf "$OUT/results.tgz" -C "$R" .
verify_summary
cat "$R/bench-headline.txt"
