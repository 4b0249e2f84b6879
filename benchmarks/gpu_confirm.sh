#!/usr/bin/env bash
# Short GPU session after a change of launch settings: the GPU-relevant tests and the full
# shapes family in parallel, then the bench points and the replays. Results in $OUT/results.tgz.
set -u
BUDGET_S=${BUDGET_S:-230}
source "$(dirname "$0")/gpu_lib.sh"
run pytest-gpu-relevant 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_bench.py \
  tests/test_kernel.py tests/test_hf_capture.py tests/test_recorder.py tests/test_sharded.py tests/test_cli_balance.py &
run validate-full-tiled-shapes 150 python3 -m routetool validate --suite full --family shapes --kernel tiled \
  --device cuda --json "$R/validate-full-tiled-shapes.json" --no-progress &
wait
COLUMNS=130 run bench 70 python3 -m routetool bench --tokens 1,64,4096,65536 --experts 256,384,512 --dtype fp32,bf16 \
  --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench.csv" --no-progress
for t in traces/*.safetensors; do
  n=$(basename "$t" .safetensors)
  COLUMNS=110 run "replay-$n" 30 python3 -m routetool replay "$t" --device cuda --no-progress --json "$R/replay-$n.json"
done
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
