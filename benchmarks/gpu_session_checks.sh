#!/usr/bin/env bash
# One device lease's checks of the recorder's eager cost and of replay --save-routing / diff on a GPU
# (run from the repository root on the GPU machine; results under $OUT):
#   recorder: benchmarks/bench_recorder.py three times in a row (the eager ratio within one machine start)
#   routing:  every bundled trace replayed on cuda with --save-routing, diffed against the reference
#             (the trace itself) and against itself, and the GPU tests of bench (its --html page)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
KPATH=$(mktemp -d)
ln -s "$PWD/kernel" "$KPATH/routetool_kernels"
export PYTHONPATH=$PWD:$KPATH${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for i in 1 2 3; do
  python3 benchmarks/bench_recorder.py --csv "$OUT/recorder-$i.csv" --json "$OUT/recorder-$i.json" 2>&1 | tail -5
done
for t in traces/*.safetensors; do
  name=$(basename "$t" .safetensors)
  python3 -m routetool replay "$t" --device cuda --no-progress --save-routing "$OUT/$name-routing.safetensors" \
    --json "$OUT/$name-replay.json" > "$OUT/$name-replay.txt" 2>&1; echo "replay $name: exit $?"
  python3 -m routetool diff "$t" "$OUT/$name-routing.safetensors" --json "$OUT/$name-diff.json" 2>&1 | head -3
  echo "diff $name reference vs kernel: exit ${PIPESTATUS[0]}"
  python3 -m routetool diff "$OUT/$name-routing.safetensors" "$OUT/$name-routing.safetensors" 2>&1 | head -1
done
python3 -m pytest -q -p no:cacheprovider -m gpu tests/analysis/test_bench.py 2>&1 | tail -2
