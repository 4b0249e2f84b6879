"""Whole-process time of ``routetool validate --suite quick`` (the suite users put in CI).

Runs ``routetool validate --suite SUITE --kernel KERNEL --device DEVICE`` ``--repeat`` times as a
whole Python process (start-up and imports included) and prints every run's wall time with the
machine's 1-minute load average before it (other work on a shared machine slows a run down), the
best, median and worst run, and the seconds its cases took per family in the best run; it appends
the best and the median to benchmarks/results.csv (benchmarks/results.py).

    python benchmarks/bench_validate.py                        # quick, tiled, CPU: the target is < 20 s
    python benchmarks/bench_validate.py --kernel seed --repeat 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_engine import _env, _machine  # (benchmarks/ is on sys.path: this script's folder)

import results


def _run(args: list[str]) -> tuple[float, float, dict]:
    """One run: (wall seconds, load average before it, the --json document)."""
    with tempfile.TemporaryDirectory(prefix="routetool-validate-") as tmp:
        out = Path(tmp) / "validate.json"
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        res = subprocess.run([*args, "--json", str(out)], env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
        wall = time.perf_counter() - t0
        if res.returncode not in (0, 1):
            sys.exit(f"{' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}")
        return wall, load, json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=("quick", "full"), default="quick")
    ap.add_argument("--kernel", default="tiled", help="kernel under test (default tiled)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--family", action="append", default=[], help="only these families (repeatable)")
    ap.add_argument("--repeat", type=int, default=5, help="runs (default 5)")
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    opts = ap.parse_args()
    args = [sys.executable, "-m", "routetool", "validate", "--suite", opts.suite, "--kernel", opts.kernel,
            "--device", opts.device, "--no-progress", *[a for f in opts.family for a in ("--family", f)]]
    commit, machine = results.commit(), _machine(opts.device)
    print(f"commit {commit}, {machine}: routetool {' '.join(args[3:])}")
    runs = []
    for i in range(opts.repeat):
        wall, load, doc = _run(args)
        cases = sum(c["duration_s"] for c in doc["cases"])
        print(f"run {i + 1}: {wall:6.2f} s wall ({cases:.2f} s in cases; load average {load:.2f} before it); "
              f"{len(doc['cases'])} cases, verdict {doc['verdict']}")
        runs.append((wall, doc))
    walls = [w for w, _ in runs]
    best, median = min(walls), statistics.median(walls)
    print(f"best {best:.2f} s, median {median:.2f} s, worst {max(walls):.2f} s of {len(walls)} runs")
    families: dict[str, float] = {}
    for c in min(runs, key=lambda r: r[0])[1]["cases"]:
        families[c["family"]] = families.get(c["family"], 0.0) + c["duration_s"]
    print("case seconds per family (best run): " + ", ".join(f"{f} {s:.2f}" for f, s in families.items()))
    if opts.csv:
        case = f"validate --suite {opts.suite} --kernel {opts.kernel} ({len(runs[0][1]['cases'])} cases)"
        results.append([[machine, "validate", case, "wall_s_best", f"{best:.3f}", "s"],
                        [machine, "validate", case, "wall_s_median", f"{median:.3f}", "s"]], opts.csv)


if __name__ == "__main__":
    main()
