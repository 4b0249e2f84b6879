# Shared by the GPU session scripts (source it): output folders, environment, and
#   run NAME SECONDS CMD...   log CMD to $R/NAME.txt, record its exit code in $S, never run
#                             past the session deadline, and repack $R into $OUT/results.tgz
#                             (the device tool returns at most 8 files).
# Set BUDGET_S (seconds for the whole session) before sourcing; default 540.
OUT=${OUT:-out}
R="$OUT/r"
mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S="$OUT/summary.txt"
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
run() {
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 10))
  if [ "$left" -lt 15 ]; then echo "$name: not run (time budget spent)" >> "$S"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$SECONDS
  timeout "$secs" "$@" > "$R/$name.txt" 2>&1
  echo "$name: exit $? ($((SECONDS - t0)) s)" >> "$S"
  tar czf "$OUT/results.tgz" -C "$R" .
}
versions() {  # GPU, driver, torch and triton versions into $S
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >> "$S"
}
# validate families other than "shapes" (the largest, run in a process of its own)
REST="--family ties --family nonfinite --family bias --family layouts --family dtypes --family padding --family parameters"
# pytest_shards NAME SECONDS N PATHS...   the tests under PATHS split into N pytest processes run
#                                        in parallel (compiling kernels is CPU-bound); logs NAME-1.txt .. NAME-N.txt
pytest_shards() {
  local name=$1 secs=$2 n=$3; shift 3
  python3 -m pytest -q -p no:cacheprovider --co "$@" 2>/dev/null | grep '::' > "$R/$name-ids.txt"
  local i
  for i in $(seq 1 "$n"); do
    # spread by a hash of the test id, so that neighbouring (similarly heavy) parametrizations part
    python3 -c "import sys, zlib; [print(l, end='') for l in open(sys.argv[1]) if zlib.crc32(l.encode()) % $n == $i - 1]" \
      "$R/$name-ids.txt" > "$R/$name-ids-$i.txt"
    run "$name-$i" "$secs" xargs -d '\n' -a "$R/$name-ids-$i.txt" python3 -m pytest -q -p no:cacheprovider &
  done
  wait
}
# validate_shapes SECONDS            validate --suite full, family shapes, on the tiled kernel
validate_shapes() {
  run validate-full-tiled-shapes "$1" python3 -m routetool validate --suite full --kernel tiled --device cuda \
    --family shapes --json "$R/validate-full-tiled-shapes.json" --no-progress
}
# validate_rest_and_replays SECONDS  the other families of validate --suite full, then a replay of every bundled trace
validate_rest_and_replays() {
  run validate-full-tiled-rest "$1" python3 -m routetool validate --suite full --kernel tiled --device cuda $REST \
    --json "$R/validate-full-tiled-rest.json" --no-progress
  local t n
  for t in traces/*.safetensors; do
    n=$(basename "$t" .safetensors)
    COLUMNS=110 run "replay-$n" 60 python3 -m routetool replay "$t" --device cuda --no-progress --json "$R/replay-$n.json"
  done
}
# bench_sweep SECONDS   the README's bench sweep (tiled vs seed, 1..65536 tokens, 128..512 experts, fp32/bf16)
bench_sweep() {
  COLUMNS=130 run bench "$1" python3 -m routetool bench --tokens 1,64,4096,16384,65536 --experts 128,256,384,512 \
    --dtype fp32,bf16 --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench.csv" --json "$R/bench.json" --no-progress
}
# verify_tree   the GPU tests (6 shards), validate --suite full (shapes in a process of its own) and the replays,
#               all in parallel (compiling is CPU-bound)
verify_tree() {
  pytest_shards pytest-gpu 420 6 tests/test_gpu.py tests/test_kernel.py tests/test_bench.py &
  validate_shapes 450 &
  validate_rest_and_replays 200 &
  wait
}
# verify_summary   the last lines of verify_tree's logs
verify_summary() {
  cat "$S"
  for f in "$R"/pytest-gpu-?.txt; do tail -n 1 "$f"; done
  tail -n 2 "$R/validate-full-tiled-shapes.txt" "$R/validate-full-tiled-rest.txt"
  for f in "$R"/replay-*.txt; do tail -n 3 "$f"; done
}
