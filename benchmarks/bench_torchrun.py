"""Replay, validate and balance of a run folder on one process and under torchrun, side by side.

Makes a run folder with ``routetool synth --ranks R`` (``--ranks``, ``--layers``, ``--decode-steps``,
``--prefill``: its size), measures the disk read rate on it (every file read once, in 16 MiB
blocks, after a first pass that warms the page cache, so the rate is the cache's unless the
folder is larger than memory), then runs each command as a whole process once alone and once as
``torchrun --standalone --nproc-per-node N`` for each N of ``--nproc``, compares every JSON
document with the single process's (timings and ``world_size`` left out) and prints the wall
time and the speed-up against one process. One long-format row per number goes to the results
file (``benchmarks/results.csv``, through ``benchmarks/results.py``).

With as many GPUs as processes each process has its own (NCCL); with fewer they share them
(gloo), which measures the cost of the split and the gather rather than a speed-up.

    python benchmarks/bench_torchrun.py --nproc 2 --ranks 4 --layers 4 --decode-steps 2000
"""

from __future__ import annotations

import argparse
import json
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

COMMANDS = {
    "replay": ["replay", "{run}", "--no-latency"],
    "validate": ["validate", "{run}", "--suite", "none"],
    "balance": ["balance", "{run}", "--ep-size", "8"],
}
VOLATILE = {"world_size", "elapsed_s", "rows_per_s", "duration_s"}


def _clean(doc):
    if isinstance(doc, dict):
        return {k: _clean(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [_clean(v) for v in doc]
    return doc


def _timed(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return wall


def _read_rate(folder: Path) -> tuple[float, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    for _ in range(2):  # the second pass is timed
        t0 = time.perf_counter()
        for p in files:
            with open(p, "rb") as fh:
                while fh.read(16 << 20):
                    pass
        wall = time.perf_counter() - t0
    return size / wall / 1e9, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", default="2", help="comma-separated process counts for torchrun")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=2000)
    ap.add_argument("--prefill", default="0")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commands", default="replay,validate,balance")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    args = ap.parse_args()
    import torch

    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU {platform.machine()} x{os.cpu_count()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="routetool-torchrun-"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "RUN"
    if not run.exists():
        subprocess.run([sys.executable, "-m", "routetool", "synth", "-o", str(run), "--ranks", str(args.ranks),
                        "--layers", str(args.layers), "--experts", str(args.experts), "--prefill", args.prefill,
                        "--decode-steps", str(args.decode_steps), "--max-decode-batch", "64", "--no-progress"],
                       env=env, check=True, capture_output=True)
    rate, size = _read_rate(run)
    case = f"{args.ranks} ranks x {args.layers} layers, {size / 2**20:.0f} MiB"
    print(f"{machine}; {case}; read rate {rate:.2f} GB/s (page cache warm)")
    rows = [[machine, "torchrun", case, "read_rate_gbps", f"{rate:.4g}", "GB/s"]]
    for name in args.commands.split(","):
        cmd = [a.replace("{run}", str(run)) for a in COMMANDS[name]] + ["--device", args.device, "--no-progress"]
        one_json = work / f"{name}-1.json"
        _timed([sys.executable, "-m", "routetool", *cmd, "--json", str(one_json), "--force"], env)  # compiles, warms
        one = _timed([sys.executable, "-m", "routetool", *cmd, "--json", str(one_json), "--force"], env)
        rows.append([machine, "torchrun", f"{name} {case} nproc=1", "wall_s", f"{one:.4g}", "s"])
        print(f"{name:9s} 1 process  {one:7.2f} s")
        for n in map(int, args.nproc.split(",")):
            out = work / f"{name}-{n}.json"
            wall = _timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           "-m", "routetool", *cmd, "--json", str(out), "--force"], env)
            same = _clean(json.loads(one_json.read_text())) == _clean(json.loads(out.read_text()))
            print(f"{name:9s} {n} processes {wall:7.2f} s  speed-up {one / wall:.2f}x  "
                  f"{'output equal' if same else 'OUTPUT DIFFERS'}")
            rows.append([machine, "torchrun", f"{name} {case} nproc={n}", "wall_s", f"{wall:.4g}", "s"])
            rows.append([machine, "torchrun", f"{name} {case} nproc={n}", "output_equal", str(int(same)), "bool"])
    if args.csv:
        results.append(rows, args.csv)


if __name__ == "__main__":
    main()
