#!/usr/bin/env bash
# One GPU session for the closing measurements: correctness runs in parallel first (they are
# compile-bound), then the timing runs one after another. Everything is packed into
# $OUT/results.tgz plus $OUT/summary.txt (the device tool returns at most 8 files).
set -u
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_lib.sh"
versions
# Phase A: compile-bound correctness, in parallel (the shapes family is the largest: its own process)
for k in tiled seed; do
  run "validate-full-$k-shapes" 200 python3 -m routetool validate --suite full --kernel $k --device cuda \
    --family shapes --json "$R/validate-full-$k-shapes.json" --junit "$R/validate-full-$k-shapes.xml" --no-progress &
  run "validate-full-$k-rest" 200 python3 -m routetool validate --suite full --kernel $k --device cuda $REST \
    --json "$R/validate-full-$k-rest.json" --junit "$R/validate-full-$k-rest.xml" --no-progress &
done
run pytest-all 200 python3 -m pytest tests -q -p no:cacheprovider -m "not gpu" &
wait
# Phase B: GPU tests and timing, one at a time
run pytest-gpu 120 python3 -m pytest tests -q -p no:cacheprovider -m gpu
for t in traces/*.safetensors; do
  n=$(basename "$t" .safetensors)
  COLUMNS=110 run "replay-$n" 60 python3 -m routetool replay "$t" --device cuda --no-progress \
    --json "$R/replay-$n.json"
done
COLUMNS=130 run bench 180 python3 -m routetool bench --tokens 1,64,4096,65536 --experts 128,256,384,512 \
  --dtype fp32,bf16 --kernel tiled --kernel seed --kernel torch --pdl both --rep-ms 8 --csv "$R/bench.csv" \
  --json "$R/bench.json" --no-progress
run tune-large 60 python3 benchmarks/tune_tiled.py --out "$R/tune-large.csv" --large-only --budget-s 50
if [ -f benchmarks/bench_balance.py ]; then
  run bench-balance 60 python3 benchmarks/bench_balance.py --device cuda --layers 8 --tokens 1000000 --repeats 2 \
    --out "$R/bench-balance-cuda.json"
fi
COLUMNS=130 run bench-compile 60 python3 -m routetool bench --tokens 64,65536 --experts 256 --dtype fp32,bf16 \
  --kernel torch-compile --kernel torch --kernel tiled --baseline torch --rep-ms 8 --csv "$R/bench-compile.csv" \
  --no-progress
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
