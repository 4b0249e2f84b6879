#!/usr/bin/env bash
# GPU session: all tests (GPU-marked included), replay of every bundled trace with latency,
# and optionally the launch-config sweep. Results land in $OUT (device tool) or ./out.
# Usage: bash benchmarks/gpu_checks.sh [tune|quick-tune]
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests -q -x -p no:cacheprovider 2>&1 | tail -n 25 | tee "$OUT/pytest.txt"
for t in traces/*.safetensors; do
  n=$(basename "$t" .safetensors)
  COLUMNS=100 python3 -m routetool replay "$t" --device cuda --no-progress --json "$OUT/replay-$n.json" --force \
    > "$OUT/replay-$n.txt" 2>&1
  echo "replay $n: exit $?"
done
case "${1:-}" in
  tune) python3 benchmarks/tune_tiled.py --out "$OUT/tune.csv" ;;
  quick-tune) python3 benchmarks/tune_tiled.py --out "$OUT/tune.csv" --quick ;;
esac
