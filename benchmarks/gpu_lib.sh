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
