#!/usr/bin/env bash
# GPU session for kernel v8 (the persistent two-level loop claims tiles from atomic counters, `dynamic_tiles`):
# where claiming starts to pay (static against claimed tiles at 16384..65536 tokens, with the size threshold
# DYNAMIC_TILES_FROM lowered to 1 so that every launch claims), then the README's bench sweep.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_lib.sh"
versions
run tune-dynamic 200 python3 benchmarks/tune_tiled.py --two-level --tokens 65536,49152,32768,24576,16384 --budget-s 190 \
  --experts 256:fp32,256:bf16,128:fp32 --launches 1:32:0:0,1:32:0:1 --variant DYNAMIC_TILES_FROM=1 --out "$R/tune-dynamic.csv"
grep "^T=" "$R/tune-dynamic.txt" >> "$S"
bench_sweep 240
grep "tiled.*65,536" "$R/bench.txt" >> "$S"
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
