#!/usr/bin/env bash
# Compile the two-level kernel for sm_90 (no GPU needed) over the kernel tests' shapes x
# launches (one or two tokens per warp, two or four warps) x persistent or not x fp32/bf16,
# printing registers and spills per launch; a compiler crash shows as a line without them.
# Usage (repository root, 2 parallel jobs): bash benchmarks/compile_check.sh > compile.txt
# (SHAPES="E,K ..." and PERSISTENT="0 1" narrow the sweep)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
one() { E=$1; K=$2; bt=$3; nw=$4; w=$5; dt=$6; p=$7
  W=$($PY -c "E,K,w=$E,$K,$w; e=1<<max(3,(E-1).bit_length()); print(max(min(w,e),1<<(K-1).bit_length()))")
  out=$(PYTHONPATH=. timeout 300 $PY benchmarks/inspect_kernel.py --algorithm two_level --experts "$E" --topk "$K" \
        --dtype "$dt" --block-t "$bt" --chunk "$W" --warps "$nw" --persistent "$p" 2>&1 |
        grep -E "registers|Assert|Error" | head -1 | cut -c1-100)
  echo "E=$E K=$K bt=$bt nw=$nw W=$W $dt persistent=$p: ${out:-no compiler output}"; }
export -f one; export PY
SHAPES=${SHAPES:-"256,8 60,4 384,8 8,8 1,1 72,1 512,22 160,6 96,6 512,16"}
for shape in $SHAPES; do shape=${shape/,/ }
  for launch in "1 1 32" "2 1 32" "4 4 32" "2 2 32"; do
    for p in ${PERSISTENT:-0 1}; do for dt in fp32 bf16; do echo "$shape $launch $dt $p"; done; done
  done
done | xargs -P 2 -L 1 bash -c 'one $0 $1 $2 $3 $4 $5 $6'
