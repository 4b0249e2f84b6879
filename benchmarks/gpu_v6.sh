#!/usr/bin/env bash
# GPU session for the two-level kernel v6 (one reduction per merge round, redo in
# registers): sweep the one-warp launches, then correctness in parallel (GPU tests and
# validate --suite full). Results in $OUT/results.tgz and $OUT/summary.txt.
set -u
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/gpu_lib.sh"
versions
run tune-v6 200 python3 benchmarks/tune_tiled.py --two-level --tokens 65536,16384 \
  --experts 256:fp32,256:bf16,384:fp32,512:fp32 --launches 1:24:0,1:28:0,1:32:0 --budget-s 180 \
  --out "$R/tune-v6.csv"
run pytest-gpu 280 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_kernel.py &
run validate-full-tiled-shapes 280 python3 -m routetool validate --suite full --kernel tiled --device cuda \
  --family shapes --json "$R/validate-full-tiled-shapes.json" --no-progress &
run validate-full-tiled-rest 280 python3 -m routetool validate --suite full --kernel tiled --device cuda $REST \
  --json "$R/validate-full-tiled-rest.json" --no-progress &
wait
cat "$S"
