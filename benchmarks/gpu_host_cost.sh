#!/usr/bin/env bash
# The routing launchers' host cost on the GPU machine, then the GPU tests:
#   1. benchmarks/bench_host_cost.py on this tree ("after"), and, when BEFORE_KERNEL names a folder holding
#      another checkout's kernel/ package (e.g. a copy of main's), on that kernel ("before"), one after the
#      other with nothing else running (host timings);
#   2. routetool bench --tokens 1,64,4096,65536 --experts 256 --dtype fp32,bf16 --kernel tiled --kernel seed
#      (graph latency and host cost per call side by side);
#   3. the tests of tests/test_gpu.py, test_kernel.py and test_bench.py in 12 parallel shards, beside
#      validate --suite full without its shapes family (the shapes family alone needs ~380 s).
# Results in $OUT/results.tgz and $OUT/summary.txt; the tables are printed last.
set -u
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/gpu_lib.sh"
versions
run host-after 150 python3 benchmarks/bench_host_cost.py --label after --csv "$R/host-after.csv"
if [ -n "${BEFORE_KERNEL:-}" ]; then
  PYTHONPATH=$BEFORE_KERNEL:$PYTHONPATH run host-before 120 python3 benchmarks/bench_host_cost.py --label before \
    --csv "$R/host-before.csv"
fi
COLUMNS=150 run bench 120 python3 -m routetool bench --tokens 1,64,4096,65536 --experts 256 --dtype fp32,bf16 \
  --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench.csv" --json "$R/bench.json" --no-progress
pytest_shards pytest-gpu 270 12 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
run validate-full-tiled-rest 200 python3 -m routetool validate --suite full --kernel tiled --device cuda $REST \
  --json "$R/validate-full-tiled-rest.json" --no-progress &
wait
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-gpu-?.txt "$R"/pytest-gpu-??.txt; do [ -f "$f" ] && tail -n 1 "$f"; done
grep -h -B2 -A12 "^FAILED\|Error" "$R"/pytest-gpu-*.txt 2>/dev/null | head -60
tail -n 2 "$R/validate-full-tiled-rest.txt"
cat "$R/bench.txt"
tail -n 40 "$R/host-before.txt" 2>/dev/null
tail -n 40 "$R/host-after.txt"
