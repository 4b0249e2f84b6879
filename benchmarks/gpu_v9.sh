#!/usr/bin/env bash
# GPU session for kernel v9 (the one-tile persistent loop of 257-512 experts claims tiles too): the claimed-tile
# GPU tests first, then static against claimed tiles at 384 and 512 experts (every launch claiming:
# DYNAMIC_TILES_FROM=1) and 256 experts as a check, then the README's bench sweep.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/gpu_lib.sh"
versions
run pytest-dynamic 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k dynamic
tail -n 1 "$R/pytest-dynamic.txt" >> "$S"
run tune-one-tile 170 python3 benchmarks/tune_tiled.py --two-level --tokens 65536,32768 --budget-s 160 \
  --experts 384:fp32,384:bf16,512:fp32,256:fp32 --launches 1:28:0:0,1:28:0:1,1:24:0:1,1:32:0:0,1:32:0:1 \
  --variant DYNAMIC_TILES_FROM=1 --out "$R/tune-one-tile.csv"
grep "^T=" "$R/tune-one-tile.txt" >> "$S"
bench_sweep 220
grep "tiled.*65,536" "$R/bench.txt" >> "$S"
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
