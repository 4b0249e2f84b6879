"""Start-up time: `routetool --help`, every subcommand's `--help` and typical usage errors, each as a
whole process (best of ``--repeat`` runs). Target: under 0.5 s each (torch, triton and rich's heavy
parts are imported only when a command runs).

    python benchmarks/bench_startup.py [--repeat 5] [--csv benchmarks/results.csv]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402 - benchmarks/results.py, the one results file

CASES = [
    ["--help"],
    *[[c, "--help"] for c in ("replay", "validate", "balance", "bench", "synth", "info", "import", "capture")],
    ["replay", "missing.safetensors"],                    # no such file
    ["validate", "missing.safetensors", "--suite", "none"],
    ["balance", "missing.jsonl"],
    ["info", "missing.safetensors"],
    ["import", "missing.jsonl", "-o", "out.safetensors"],
    ["replay", "--no-such-option"],                       # click's usage error
    ["synth", "--layers", "0", "-o", "out.safetensors"],  # a value out of range
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    opts = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    machine = f"CPU {platform.machine()} x{os.cpu_count()}"
    rows, worst = [], 0.0
    with tempfile.TemporaryDirectory() as cwd:
        for args in CASES:
            best = float("inf")
            for _ in range(opts.repeat):
                t0 = time.perf_counter()
                res = subprocess.run([sys.executable, "-m", "routetool", *args], cwd=cwd, env=env,
                                     capture_output=True, text=True)
                best = min(best, time.perf_counter() - t0)
            worst = max(worst, best)
            line = " ".join(args)
            print(f"{best:6.3f} s  exit {res.returncode}  routetool {line}")
            rows.append([machine, "startup", f"routetool {line}", "wall_s", f"{best:.3f}", "s"])
    print(f"slowest: {worst:.3f} s (target: < 0.5 s)")
    if opts.csv:
        results.append(rows, opts.csv)


if __name__ == "__main__":
    main()
