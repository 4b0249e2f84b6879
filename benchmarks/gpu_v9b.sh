#!/usr/bin/env bash
# GPU session for padded launches (v9): with an is_padding mask the two-tile persistent loop needs 79-80 registers
# at 256 experts (57-58 without; benchmarks/inspect_kernel.py), so fewer programs reside. Times 5%-padded launches
# with the two-tile loop (default) against the one-tile loop (PING_PONG_MAX_SLICES=4), and without padding.
# Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/gpu_lib.sh"
versions
L=1:32:0:1,1:28:0:1,1:24:0:1,1:32:0:0
run tune-padded-two-tile 150 python3 benchmarks/tune_tiled.py --two-level --tokens 65536,32768 --budget-s 140 \
  --experts 256:fp32,256:bf16 --launches $L --padding 0.05 --out "$R/tune-padded-two-tile.csv"
grep "^T=" "$R/tune-padded-two-tile.txt" >> "$S"
run tune-padded-one-tile 150 python3 benchmarks/tune_tiled.py --two-level --tokens 65536,32768 --budget-s 140 \
  --experts 256:fp32,256:bf16 --launches $L --padding 0.05 --variant PING_PONG_MAX_SLICES=4 \
  --out "$R/tune-padded-one-tile.csv"
grep "^T=" "$R/tune-padded-one-tile.txt" >> "$S"
run tune-unpadded 80 python3 benchmarks/tune_tiled.py --two-level --tokens 65536 --budget-s 70 \
  --experts 256:fp32 --launches 1:32:0:1 --out "$R/tune-unpadded.csv"
grep "^T=" "$R/tune-unpadded.txt" >> "$S"
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
