#!/usr/bin/env bash
# The GPU checks and benchmarks, by mode, on a GPU machine (run from the repository root):
#
#   bash benchmarks/gpu.sh [MODE ...]      (default: tests validate replays bench host engine)
#
#   tests     every test marked gpu, and all kernel and bench tests (compiled), in parallel shards
#   gpu-tests only the tests marked gpu, in parallel shards (a shorter check of GPU paths); PYTEST_K="EXPR": only
#             the tests pytest's -k EXPR selects (tests and gpu-tests)
#   validate  routetool validate --suite full --kernel tiled, every family but models (the shapes in VALIDATE_NPROC
#             processes under torchrun, as models; the others in one)
#   models    routetool validate --suite full --kernel tiled --family models, in VALIDATE_NPROC processes (default 8)
#             under torchrun: alone in a call, it compiles for minutes on a fresh machine (quick holds it too)
#   quick     routetool validate --suite quick --kernel tiled (after the others, under torchrun as models)
#   replays   routetool replay of every bundled trace, with latency
#   bench     routetool bench: tiled vs seed, 64 and 65536 tokens, 256 experts, fp32 and bf16
#   table     routetool bench: the tiled kernel's table (1 to 65536 tokens, 128 to 512 experts, fp32 and bf16)
#   host      benchmarks/bench_host_cost.py: host cost per call against an empty Triton launch
#   engine    benchmarks/bench_engine.py --set gpu: replay, balance and validate against a raw read
#   recorder  the recorder under CUDA graphs: tests/capture/test_capture_gpu.py and the record kernel's parity
#             (tests/capture/test_ring.py), then benchmarks/bench_recorder.py (overhead per routing call;
#             RECORDER_RUNS=N runs it N times)
#   routing   replay --save-routing of every bundled trace on the GPU, then diff of each trace (the reference)
#             against the kernel's saved routing, and of the saved routing against itself
#   floor     benchmarks/bench_rows_floor.py: the rows launch's grid alone, its load pattern alone, whole-row loads
#             and the router (65536 x 256 bf16, $FLOOR_ARGS); its rows in results.csv (benchmark floor)
#   tune      benchmarks/tune_tiled.py $TUNE_ARGS --variant "$TUNE_VARIANTS" (';'-separated switch sets): each
#             set compiled first in a process of its own, side by side (one per set and per ';'-separated argument
#             list of $TUNE_SPLIT, e.g. "--experts 256:bf16;--experts 128:fp32"), then every candidate timed alone
#   profile   Nsight Compute (--set full, clocks as found) on benchmarks/profile_kernel.py, once per ';'-separated
#             argument list of $PROFILE_ARGS (e.g. "--dtype bf16 --algorithm rows --chunk 1 --warps 2"); the
#             reports' details in $OUT/r/profile-N.txt, per SASS instruction in $OUT/r/profile-N-sass.csv
#   ranks     run folders and torchrun on the GPU: tests/io/test_run_folder.py (2 processes: NCCL with a GPU
#             each, gloo sharing one GPU otherwise), then benchmarks/bench_torchrun.py (one process against
#             torchrun on a 4-rank synth run folder: wall time, speed-up, equal outputs)
#
# tests and validate run first, side by side (compiling is CPU-bound); the timed modes run after them, alone.
# Logs go to $OUT/r/ (packed into $OUT/results.tgz), the exit code of each step to $OUT/summary.txt, and the
# measurements, one long-format row each, to $OUT/results.csv: append it to benchmarks/results.csv
# (`tail -n +2 results.csv >> benchmarks/results.csv`). BUDGET_S (default 570) bounds the whole run;
# ROUTETOOL_COMMIT names the commit where the copy's git folder is not the checkout's.
set -u
OUT=${OUT:-out}
R="$OUT/r"
S="$OUT/summary.txt"
mkdir -p "$R"
# the checkout on the path as installed: the folder kernel/ imports as routetool_kernels (a link
# to it in a folder of its own, so that nothing needs pip or a registry)
KPATH=$(mktemp -d)
ln -s "$PWD/kernel" "$KPATH/routetool_kernels"
export PYTHONPATH=$PWD:$KPATH${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
MODES=${*:-tests validate replays bench host engine}
TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "${VALIDATE_NPROC:-8}")  # models, quick
RESULTS="$OUT/results.csv"

run() {  # run NAME SECONDS CMD...: log to $R/NAME.txt, exit code to $S, never past the deadline
  local name=$1 secs=$2; shift 2
  local left=$((DEADLINE - SECONDS - 10))
  if [ "$left" -lt 15 ]; then echo "$name: not run (time budget spent)" >> "$S"; return; fi
  [ "$secs" -gt "$left" ] && secs=$left
  local t0=$SECONDS
  timeout "$secs" "$@" > "$R/$name.txt" 2>&1
  echo "$name: exit $? ($((SECONDS - t0)) s)" >> "$S"
  tar czf "$OUT/results.tgz" -C "$R" .
}
has() { case " $MODES " in *" $1 "*) return 0 ;; esac; return 1; }

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${ROUTETOOL_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null)}"; } >> "$S"

if has tests || has gpu-tests; then
  K=(${PYTEST_K:+-k "$PYTEST_K"})
  { has tests && python3 -m pytest -q -p no:cacheprovider --co "${K[@]}" tests/kernel/test_kernel.py tests/analysis/test_bench.py 2>/dev/null
    python3 -m pytest -q -p no:cacheprovider --co -m gpu "${K[@]}" tests 2>/dev/null; } | grep '::' | sort -u > "$R/pytest-ids.txt"
  for i in 1 2 3 4 5 6; do
    # spread by a hash of the test id, so that neighbouring (similarly heavy) parametrizations part (a shard with no
    # test runs nothing: xargs -r)
    python3 -c "import sys, zlib; [print(l, end='') for l in open(sys.argv[1]) if zlib.crc32(l.encode()) % 6 == $i - 1]" \
      "$R/pytest-ids.txt" > "$R/pytest-ids-$i.txt"
    run "pytest-$i" 420 xargs -r -d '\n' -a "$R/pytest-ids-$i.txt" python3 -m pytest -q -p no:cacheprovider &
  done
fi
if has validate; then
  run validate-shapes 450 "${TORCHRUN[@]}" -m routetool validate --suite full --kernel tiled --device cuda \
    --family shapes --json "$R/validate-shapes.json" --no-progress &
  run validate-rest 300 python3 -m routetool validate --suite full --kernel tiled --device cuda --family ties \
    --family nonfinite --family bias --family layouts --family dtypes --family padding --family parameters \
    --json "$R/validate-rest.json" --no-progress &
fi
if has models; then
  # the models family compiles the most (each model's launch at every batch switch; two-level at 512-896 experts and
  # topk 16-22 over a minute a launch): VALIDATE_NPROC processes share its cases (torchrun on one GPU, gloo)
  run validate-models 540 "${TORCHRUN[@]}" -m routetool validate --suite full --kernel tiled --device cuda \
    --family models --json "$R/validate-models.json" --no-progress &
fi
wait
if has quick; then  # (after the models family: the same models' launches, then in the compile cache)
  run validate-quick 300 "${TORCHRUN[@]}" -m routetool validate --suite quick --kernel tiled --device cuda \
    --json "$R/validate-quick.json" --no-progress
fi
if has replays; then
  for t in traces/*.safetensors; do
    n=$(basename "$t" .safetensors)
    COLUMNS=100 run "replay-$n" 90 python3 -m routetool replay "$t" --device cuda --no-progress --json "$R/replay-$n.json"
  done
fi
if has bench; then
  COLUMNS=150 run bench 150 python3 -m routetool bench --tokens 64,65536 --experts 256 --dtype fp32,bf16 \
    --kernel tiled --kernel seed --rep-ms 8 --csv "$R/bench.csv" --no-progress
  python3 benchmarks/results.py from-bench "$R/bench.csv" --out "$RESULTS"
fi
if has table; then
  COLUMNS=150 run table 480 python3 -m routetool bench --tokens 1,64,4096,16384,65536 --experts 128,256,384,512 \
    --dtype fp32,bf16 --kernel tiled --rep-ms 8 --csv "$R/table.csv" --no-progress
  python3 benchmarks/results.py from-bench "$R/table.csv" --out "$RESULTS"
fi
if has host; then
  run host 150 python3 benchmarks/bench_host_cost.py --label after --csv "$R/host.csv"
  python3 benchmarks/results.py from-host "$R/host.csv" --out "$RESULTS"
fi
if has engine; then
  run engine 300 python3 benchmarks/bench_engine.py --set gpu --workdir /tmp/routetool-engine --csv "$RESULTS"
fi
if has recorder; then
  run recorder-tests 240 python3 -m pytest -q -p no:cacheprovider tests/capture/test_capture_gpu.py tests/capture/test_ring.py
  for i in $(seq "${RECORDER_RUNS:-1}"); do  # the eager ratio moves with the host: several runs in one start
    run "recorder-bench${i#1}" 150 python3 benchmarks/bench_recorder.py --csv "$RESULTS" --json "$R/recorder$i.json"
  done
fi
if has routing; then
  for t in traces/*.safetensors; do
    n=$(basename "$t" .safetensors)
    COLUMNS=100 run "routing-$n" 120 python3 -m routetool replay "$t" --device cuda --no-progress --no-latency \
      --save-routing "$R/routing-$n.safetensors"
    COLUMNS=100 run "diff-$n" 60 python3 -m routetool diff "$t" "$R/routing-$n.safetensors" --json "$R/diff-$n.json"
    COLUMNS=100 run "diff-self-$n" 60 python3 -m routetool diff "$R/routing-$n.safetensors" "$R/routing-$n.safetensors"
  done
fi
if has floor; then
  # shellcheck disable=SC2086
  run floor 120 python3 benchmarks/bench_rows_floor.py ${FLOOR_ARGS:-} --csv "$RESULTS"
fi
if has tune; then
  IFS=';' read -ra SETS <<< "${TUNE_VARIANTS:-}"
  [ "${#SETS[@]}" -eq 0 ] && SETS=("")
  IFS=';' read -ra SPLITS <<< "${TUNE_SPLIT:-}"
  [ "${#SPLITS[@]}" -eq 0 ] && SPLITS=("")
  i=0
  for vs in "${SETS[@]}"; do
    for sp in "${SPLITS[@]}"; do
      i=$((i + 1))
      # shellcheck disable=SC2086
      run "tune-compile-$i" 300 python3 benchmarks/tune_tiled.py --compile-only --out /dev/null ${TUNE_ARGS:-} $sp \
        --variant "$vs" &
    done
  done
  wait
  run tune 420 python3 benchmarks/tune_tiled.py --out "$R/tune.csv" ${TUNE_ARGS:-} --variant "${TUNE_VARIANTS:-}"
fi
if has profile; then
  IFS=';' read -ra PROFILES <<< "${PROFILE_ARGS:---dtype bf16}"
  i=0
  for pa in "${PROFILES[@]}"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    run "profile-run-$i" 200 ncu --clock-control none --kernel-name regex:'_rows_kernel|_two_level_kernel|_routing_kernel' \
      --launch-skip 2 --launch-count 1 --set full -f -o "$R/profile-$i" python3 benchmarks/profile_kernel.py $pa
    [ -f "$R/profile-$i.ncu-rep" ] && { echo "# profile_kernel.py $pa"; ncu --import "$R/profile-$i.ncu-rep" --page details \
      --print-details all; } > "$R/profile-$i.txt" 2>&1
    # per SASS instruction: executions and stall samples by reason (where the warps wait)
    [ -f "$R/profile-$i.ncu-rep" ] && ncu --import "$R/profile-$i.ncu-rep" --page source --csv --print-source sass \
      > "$R/profile-$i-sass.csv" 2> "$R/profile-$i-sass.err"
  done
fi
if has ranks; then
  run ranks 300 python3 -m pytest -q -p no:cacheprovider tests/io/test_run_folder.py
  run torchrun 300 python3 benchmarks/bench_torchrun.py --nproc ${NPROC:-2} --ranks 4 --layers 4 --decode-steps 1500 \
    --workdir /tmp/routetool-torchrun --csv "$RESULTS"
fi
tar czf "$OUT/results.tgz" -C "$R" .
cat "$S"
for f in "$R"/pytest-?.txt; do [ -f "$f" ] && tail -n 1 "$f"; done
grep -h -A8 "^FAILED\|^E  " "$R"/pytest-?.txt 2>/dev/null | head -40
for f in "$R"/validate-*.txt "$R"/replay-*.txt "$R"/routing-*.txt "$R"/diff-*.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^(PASS|FAIL|NOTHING|IDENTICAL|DIFFERENT)" "$f"; }; done
[ -f "$R/tune.txt" ] && { echo "== tune"; grep -E "^T=|^  " "$R/tune.txt" | tail -n 80; }
for f in "$R"/profile-?.txt; do [ -f "$f" ] && { echo "== $f"; grep -E "^# |Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|Executed Ipc A|L1/TEX Hit|Mem Busy|Max Bandwidth|DRAM Throughput|No Eligible|One or More Eligible|Warp Cycles Per Issued" "$f" | head -n 20; }; done
for f in floor bench table host engine recorder-tests recorder-bench recorder-bench2 recorder-bench3 ranks torchrun; do [ -f "$R/$f.txt" ] && { echo "== $f"; tail -n 20 "$R/$f.txt"; }; done
