#!/usr/bin/env bash
# Why gpu_v6e.sh ran out of time: the slowest kernel test alone (two-row tiles, 512 experts, topk 22), and
# validate's full shapes family case by case with each case's time (stack dumps every 60 s show where a
# case spends it: compiling, not on the GPU), GPU utilisation sampled every 5 s.
set -u
BUDGET_S=${BUDGET_S:-280}
source "$(dirname "$0")/gpu_lib.sh"
versions
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$R/nvidia-smi.txt" 2>&1 &
SMI=$!
run pytest-bt2-512-22 240 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=60 \
  "tests/test_kernel.py::test_tiled_matches_reference[two_level_bt2-dtype0-1e-05-2-512-22]" &
run diag-shapes 250 python3 benchmarks/diag_cases.py --suite full --family shapes --dump-s 60 &
wait %2 %3
kill $SMI
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
