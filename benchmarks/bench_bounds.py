"""What the bounds cost and hold, measured (the tests assert the bounds, never a time):

* the hostile-input campaign's wall time (tests/hostile.py; the test bounds each case instead);
* the peak anonymous memory of ``balance --reference`` and ``info --scan`` on a sparse trace of
  one step much larger than the 64 MiB chunk (default 16M rows of 8 experts: 512 MiB of
  scores, read in pieces), against the same rows in 64 steps, and ``replay``'s refusal of a step
  past the 1 GiB a kernel under test is given whole.

    python benchmarks/bench_bounds.py [--cases 1500] [--rows 16777216]

Prints one JSON document (with the torch version and the CPU count beside the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_large_steps import _PEAK, sparse_trace  # noqa: E402  (one writer of sparse traces)


def _peak(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, env=env)
    return {"exit_code": proc.returncode, "seconds": round(time.perf_counter() - start, 2),
            "peak_anon_mib": round(int(proc.stderr.strip().splitlines()[-1]) / 2**20, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1500, help="hostile campaign cases (0: skip)")
    parser.add_argument("--rows", type=int, default=16 * 2**20, help="rows of the one-step trace (8 experts)")
    args = parser.parse_args()
    import torch

    out: dict = {"torch_version": torch.__version__, "cpus": os.cpu_count()}
    if args.cases:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "hostile.py"), "--seed", "18", "--cases",
                               str(args.cases)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        report = json.loads(proc.stdout)
        out["hostile_campaign"] = {"cases": report["cases"], "wall_s": round(time.perf_counter() - start, 1),
                                   "slowest_case_s": [r["seconds"] for r in report["slowest"]],
                                   "failures": len(report["failures"])}
    with tempfile.TemporaryDirectory() as tmp:
        one = sparse_trace(Path(tmp) / "one-step.safetensors", args.rows)
        many = sparse_trace(Path(tmp) / "64-steps.safetensors", args.rows, steps=64)
        huge = sparse_trace(Path(tmp) / "past-the-kernel-bound.safetensors", 64 * 2**20)  # 2 GiB in one step
        base = _peak(["info", str(ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors")])
        out["baseline_info_peak_anon_mib"] = base["peak_anon_mib"]
        out["rows"] = args.rows
        for name, path in (("one_step", one), ("64_steps", many)):
            out[name] = {
                "balance_reference": _peak(["balance", str(path), "--reference", "--no-progress", "--device", "cpu"]),
                "info_scan": _peak(["info", str(path), "--scan", "--no-progress"]),
            }
        out["past_the_kernel_bound"] = {"replay": _peak(["replay", str(huge), "--no-latency", "--no-progress",
                                                         "--device", "cpu"])}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
