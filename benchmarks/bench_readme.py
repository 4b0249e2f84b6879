"""The README's times, measured as a newcomer meets them: the README's commands, each as a whole
process, run by the ``routetool`` of a fresh virtual environment, from the repository root.

With ``--venv DIR`` (a folder that does not exist yet) it first makes that environment as the
README says (``python -m venv DIR``, ``pip install torch --index-url .../whl/cpu``, ``pip install
-e .``: the install is timed too); with ``--routetool PATH`` it uses an installed one. Each
command runs ``--repeat`` times; the first run is the one a newcomer waits for (its imports not
yet in the page cache nor in the bytecode caches), the others show the spread. Every run is
printed with the machine's 1-minute load average before it: on a shared machine other work slows
a run down, so read a time with the load beside it. The first run, the best and the median of
each command are appended to benchmarks/results.csv (benchmarks/results.py).

    python benchmarks/bench_readme.py --venv /tmp/routetool-venv            # fresh venv, then time
    python benchmarks/bench_readme.py --routetool /tmp/routetool-venv/bin/routetool --repeat 5
    python benchmarks/bench_readme.py --routetool routetool --only replay
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import results  # noqa: E402 - benchmarks/results.py, the one results file

COMMANDS = {
    # name -> the README's command line (after `routetool`), as a newcomer types it
    "replay": ["replay", "traces/musespark1x-synth-bf16.safetensors"],
    "validate": ["validate"],
    "balance": ["balance", "traces/musespark1x-synth-bf16.safetensors"],
}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _timed(args: list[str], env: dict | None = None) -> tuple[float, float, int]:
    """(wall seconds, load average before, exit code) of one whole process, run from the repository root."""
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if res.returncode not in (0, 1):
        sys.exit(f"{' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return wall, load, res.returncode


def make_venv(folder: Path, torch_index: str) -> Path:
    """A fresh environment as the README installs one; the ``routetool`` it holds. ``torch_index``:
    where the CPU build of torch comes from ('' for pip's own configuration, e.g. a machine whose
    wheel folder holds it)."""
    if folder.exists():
        sys.exit(f"{folder}: exists; --venv makes a fresh environment in a new folder")
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q"]
    for label, args in (("python -m venv", [sys.executable, "-m", "venv", str(folder)]),
                        ("pip install torch (CPU build)",
                         [*pip, "torch", *(["--index-url", torch_index] if torch_index else [])]),
                        ("pip install -e .", [*pip, "-e", "."])):
        wall, load, _ = _timed(args)
        print(f"{label}: {wall:.1f} s (load average {load:.2f} before it)")
    return folder / "bin" / "routetool"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--venv", type=Path, help="make a fresh virtual environment here first (a new folder)")
    where.add_argument("--routetool", help="the routetool executable of an installed environment")
    ap.add_argument("--torch-index", default=TORCH_CPU_INDEX,
                    help=f"--venv: the index of torch's CPU build (default {TORCH_CPU_INDEX}; '' for pip's configuration)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per command (default 3; the first is the cold one)")
    ap.add_argument("--only", action="append", choices=sorted(COMMANDS), help="only these commands (repeatable)")
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    opts = ap.parse_args()
    exe = str(make_venv(opts.venv, opts.torch_index)) if opts.venv else opts.routetool
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    machine = f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"
    print(f"commit {results.commit()}, {machine}, {exe}")
    rows = []
    for name in opts.only or COMMANDS:
        walls, loads = [], []
        for i in range(opts.repeat):
            wall, load, code = _timed([exe, *COMMANDS[name]], env)
            walls.append(wall)
            loads.append(load)
            print(f"routetool {' '.join(COMMANDS[name])}: run {i + 1} {wall:6.2f} s (exit {code}; load average "
                  f"{load:.2f} before it)")
        best, median = min(walls), statistics.median(walls)
        print(f"  first {walls[0]:.2f} s, best {best:.2f} s, median {median:.2f} s of {len(walls)}")
        case = f"routetool {' '.join(COMMANDS[name])} (fresh venv)" if opts.venv else f"routetool {' '.join(COMMANDS[name])}"
        rows += [[machine, "readme", case, metric, f"{value:.3f}", "s"]
                 for metric, value in (("wall_s_first", walls[0]), ("wall_s_best", best), ("wall_s_median", median))]
        rows += [[machine, "readme", case, "load_average_1min_before_max", f"{max(loads):.2f}", "processes"]]
    if opts.csv:
        results.append(rows, opts.csv)


if __name__ == "__main__":
    main()
