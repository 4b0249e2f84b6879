"""Run validate's suite cases one at a time, printing each case's verdict and seconds as it ends.

Usage: python benchmarks/validate_cases.py --suite full --family models [--device cuda] [--shard I/N]

Where `routetool validate` prints nothing until its last case (a run cut off by a time limit says nothing), this
shows which cases take the time: on a cold Triton cache, the compiles of each case's launches. `--shard I/N` runs
every N-th case from the I-th (0-based), so N processes side by side cover the suite; `--stacks SECONDS` prints the
Python stacks whenever one case runs longer (where it waits: a compile, a kernel).
"""

import argparse
import faulthandler
import sys
import time

from routetool.analysis.suite import build_suite
from routetool.analysis.validate import run_case
from routetool.engine.execution import load_kernel, select_execution

ap = argparse.ArgumentParser()
ap.add_argument("--suite", default="full", choices=("quick", "full"))
ap.add_argument("--family", action="append", default=[])
ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
ap.add_argument("--kernel", default="tiled")
ap.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th")
ap.add_argument("--stacks", type=float, default=0, help="print the stacks of a case running longer than this (s)")
a = ap.parse_args()
i, n = map(int, a.shard.split("/"))
execution = select_execution(a.device)
name, fn = load_kernel(a.kernel)
execution = execution.for_kernel(fn)
cases = build_suite(a.suite, a.family or None)[i::n]
t00 = time.perf_counter()
for case in cases:
    if a.stacks:
        faulthandler.dump_traceback_later(a.stacks, repeat=True, file=sys.stderr)
    t = time.perf_counter()
    res = run_case(case, fn, execution, tie_ulps=16.0)
    faulthandler.cancel_dump_traceback_later()
    now = time.perf_counter()
    print(f"{now - t:7.1f} s {now - t00:7.1f} s  {res.verdict:<9} {case.name}  {(res.message or '')[:150]}", flush=True)
