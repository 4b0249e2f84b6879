"""The results file, benchmarks/results.csv: one measurement a row, in long format, with the date, the
git commit and the machine on every row (columns: date, commit, machine, benchmark, case, metric, value,
unit). History is git's and NOTES.md's; this file is only appended to.

    python benchmarks/results.py from-bench BENCH.csv [--out results.csv]   # a `routetool bench --csv` file
    python benchmarks/results.py from-host HOST.csv [--out results.csv]     # a bench_host_cost.py --csv file
    python benchmarks/results.py from-tune TUNE.csv [--base "ROWS_AHEAD=2,..."] [--machine NAME]
                                                         # a tune_tiled.py --out file; --base: the policy switches
                                                         # the sweep ran with, so that every case names them all

Rows are appended to ``--out`` (default benchmarks/results.csv), the header written when it is new.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.csv"
COLUMNS = ["date", "commit", "machine", "benchmark", "case", "metric", "value", "unit"]


def commit() -> str:
    """The checkout's short commit, ``+dirty`` when tracked files differ from it; ``ROUTETOOL_COMMIT``
    when set (a copy of the working tree whose git folder is not the checkout's, as on a lent GPU machine)."""
    if os.environ.get("ROUTETOOL_COMMIT"):
        return os.environ["ROUTETOOL_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def append(rows: list[list], out: str | Path = RESULTS) -> None:
    """Append ``rows`` (``[machine, benchmark, case, metric, value, unit]`` each) with today's date and the commit."""
    path = Path(out)
    new = not path.exists() or path.stat().st_size == 0
    date, rev = datetime.date.today().isoformat(), commit()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(COLUMNS)
        for row in rows:
            w.writerow([date, rev, *row])


def from_bench(path: str) -> list[list]:
    rows = []
    for r in csv.DictReader(open(path, newline="")):
        case = (f"{r['kernel']} T={r['num_tokens']} E={r['num_experts']} k={r['topk']} {r['dtype']}"
                + (f" pdl={r['pdl']}" if r.get("pdl") not in (None, "", "None") else ""))
        if r["status"] != "ok":
            rows.append([r["gpu_name"], "bench", case, "status", r["status"], ""])
            continue
        for metric, unit in (("latency_us_p50", "us"), ("latency_us_p10", "us"), ("latency_us_p90", "us"),
                             ("host_us_p50", "us"), ("host_over_empty_launch", "x"), ("bandwidth_gbps", "GB/s")):
            if r.get(metric) not in (None, ""):
                rows.append([r["gpu_name"], "bench", case, metric, f"{float(r[metric]):.4g}", unit])
    return rows


def from_host(path: str) -> list[list]:
    rows = []
    for r in csv.DictReader(open(path, newline="")):
        case = " ".join(v for v in (r["what"], r.get("variant", ""), r.get("dtype", ""),
                                    f"T={r['num_tokens']} E={r['num_experts']}") if v)
        for metric, unit in (("host_us_p50", "us"), ("empty_launch_host_us_p50", "us"), ("host_over_empty_launch", "x")):
            if r.get(metric) not in (None, ""):
                rows.append([r["gpu"], "host-cost", case, metric, f"{float(r[metric]):.4g}", unit])
    return rows


def from_tune(path: str, base: str = "", machine: str = "") -> list[list]:
    """Rows of a tune_tiled.py sweep: each candidate's p50/p10/p90, its case naming the algorithm, shape, launch
    and (``base`` overridden by its variant's switches) every policy switch it ran with."""
    defaults = dict(item.split("=") for item in base.split(",") if item)
    rows = []
    for r in csv.DictReader(open(path, newline="")):
        variant, _, switches = r["variant"].partition("[")
        values = defaults | dict(item.split("=") for item in switches.rstrip("]").split(",") if item)
        extra = "".join(f" {key}={r[key]}" for key in ("programs_per_sm", "max_registers")
                        if r.get(key) not in (None, "", "0"))
        launch = (f"{r['algorithm']} threads={r['chunk']} warps={r['num_warps']}{extra}" if r["algorithm"] == "rows" else
                  f"{r['algorithm']} block_t={r['block_t']} chunk={r['chunk']} warps={r['num_warps']}"
                  if r["algorithm"] else "")
        if r["algorithm"] != "rows":
            values = {}
        case = " ".join(v for v in (variant, f"T={r['num_tokens']} E={r['num_experts']} k={r['topk']} {r['dtype']}",
                                    launch, ",".join(f"{k}={v}" for k, v in sorted(values.items()))) if v)
        for metric in ("p50_us", "p10_us", "p90_us"):
            value = float(r[metric])
            if value == value:  # (NaN: the candidate failed its check)
                rows.append([machine, "tune", case, "latency_us_" + metric.removesuffix("_us"), f"{value:.4g}", "us"])
        if r["correct"] != "True":
            rows.append([machine, "tune", case, "status", "wrong", ""])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=["from-bench", "from-host", "from-tune"])
    ap.add_argument("path")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--base", default="", help="from-tune: the policy switches the sweep ran with (NAME=V,...)")
    ap.add_argument("--machine", default="", help="from-tune: the GPU's name (the sweep's CSV has none)")
    opts = ap.parse_args()
    read = {"from-bench": lambda: from_bench(opts.path), "from-host": lambda: from_host(opts.path),
            "from-tune": lambda: from_tune(opts.path, opts.base, opts.machine)}
    append(read[opts.kind](), opts.out)


if __name__ == "__main__":
    main()
