"""Run validate suite cases one at a time, printing each case's name, time and verdict as it goes.

A case that hangs shows as the last name printed; every ``--dump-s`` seconds the Python stacks
of all threads go to stderr, so a hang in compilation and one on the GPU tell apart.

Usage: python benchmarks/diag_cases.py --suite full --family shapes [--kernel tiled] [--device cuda]
"""
import argparse
import faulthandler
import sys
import time

from routetool.suite import build_suite
from routetool.validate import run_case
from routetool.execution import load_kernel, select_execution

ap = argparse.ArgumentParser()
ap.add_argument("--suite", default="full")
ap.add_argument("--family", action="append")
ap.add_argument("--kernel", default="tiled")
ap.add_argument("--device", default="cuda")
ap.add_argument("--match", default="", help="only cases whose name contains this")
ap.add_argument("--dump-s", type=float, default=60.0)
a = ap.parse_args()
faulthandler.dump_traceback_later(a.dump_s, repeat=True, file=sys.stderr)
_, fn = load_kernel(a.kernel)
execution = select_execution(a.device)
for case in build_suite(a.suite, a.family):
    if a.match not in case.name:
        continue
    print(f"{case.name} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    res = run_case(case, fn, execution, tie_ulps=16.0)
    print(f"{res.verdict} {time.perf_counter() - t0:.1f} s {res.message or ''}", flush=True)
