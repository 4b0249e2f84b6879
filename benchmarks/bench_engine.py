"""Whole-process time of replay, balance and validate against a raw read of the same trace.

Makes the traces with ``routetool synth``, then times, each as a whole Python process (start-up,
imports and the read included) and in the same run:

* the raw read: every tensor of the trace read with safetensors and moved to the device;
* ``replay --no-latency``, ``balance --ep-size 8`` and ``validate --suite none`` (``--set gpu``),
  or ``balance --reference`` (``--set cpu``).

It prints, per trace and command, the best of ``--repeat`` runs (at least 2 on the GPU: the first run of a
command compiles the kernel's launch configurations it meets, which Triton then keeps on disk), the ratio to the raw read and
the work per captured step beyond the read ((command - raw read) / steps), and appends one row
per measurement to the results CSV (long format, with the commit and the machine on every row).

    python benchmarks/bench_engine.py --set gpu    # the H200 targets: <= 1.5x the raw read, < 50 us a step
    python benchmarks/bench_engine.py --set cpu    # the CPU target: balance --reference <= 2x the raw read
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

RESULTS = results.RESULTS

TRACES = {
    "gpu": {
        "decode-heavy": ["--layers", "8", "--prefill", "0", "--decode-steps", "3000", "--max-decode-batch", "64",
                         "--bias", "fitted"],
        "prefill-heavy": ["--layers", "16", "--prefill", "65536", "--decode-steps", "0", "--bias", "fitted"],
    },
    "cpu": {
        "decode-2x2000": ["--layers", "2", "--prefill", "0", "--decode-steps", "2000", "--max-decode-batch", "64",
                          "--bias", "fitted"],
    },
}
COMMANDS = {
    "gpu": {
        "replay": ["replay", "{trace}", "--no-latency", "--device", "cuda"],
        "balance": ["balance", "{trace}", "--ep-size", "8", "--device", "cuda"],
        "validate": ["validate", "{trace}", "--suite", "none", "--device", "cuda"],
    },
    "cpu": {
        "balance-reference": ["balance", "{trace}", "--reference", "--device", "cpu"],
    },
}
RAW_READ = """
import sys, torch
from safetensors import safe_open
device = sys.argv[2]
with safe_open(sys.argv[1], framework="pt", device="cpu") as f:
    for name in f.keys():
        f.get_tensor(name).to(device)
if device == "cuda":
    torch.cuda.synchronize()
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    return env


def _timed(args: list[str], repeat: int) -> float:
    """Best wall time of ``repeat`` runs of ``args`` (seconds); a failing run stops the benchmark."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = subprocess.run(args, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        elapsed = time.perf_counter() - t0
        if res.returncode not in (0, 1):
            sys.exit(f"{' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}")
        best = min(best, elapsed)
    return best


def _steps(trace: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from routetool.io.trace import open_trace

    with open_trace(trace) as t:
        return sum(t.info(layer).num_steps for layer in t.layers)


def _machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(TRACES), default="gpu", help="which traces and commands (default gpu)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per measurement, best kept (default 2 gpu, 3 cpu)")
    ap.add_argument("--workdir", default=None, help="where the traces go (default a temporary folder)")
    ap.add_argument("--csv", default=str(RESULTS), help="results file to append to ('' for none)")
    opts = ap.parse_args()
    device = "cuda" if opts.set == "gpu" else "cpu"
    repeat = opts.repeat or (2 if opts.set == "gpu" else 3)
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="routetool-engine-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    rows = []
    machine = _machine(device)
    print(f"commit {results.commit()}, {machine}, best of {repeat}")
    print(f"{'trace':15} {'command':18} {'wall s':>8} {'raw s':>7} {'x raw':>6} {'us/step':>8}")
    for name, synth_args in TRACES[opts.set].items():
        trace = work / f"{name}.safetensors"
        if not trace.exists():
            subprocess.run([py, "-m", "routetool", "synth", *synth_args, "-o", str(trace), "--no-progress"],
                           env=_env(), check=True, stdout=subprocess.DEVNULL)
        steps = _steps(trace)
        raw = _timed([py, "-c", RAW_READ, str(trace), device], repeat)
        size_mib = trace.stat().st_size / 2**20
        print(f"{name:15} {'raw read':18} {raw:8.2f} {raw:7.2f} {1.0:6.2f} {'':>8}   "
              f"({size_mib:.0f} MiB, {steps:,} steps)")
        rows.append((name, "raw-read", raw, raw, steps, size_mib))
        for cmd, template in COMMANDS[opts.set].items():
            args = [py, "-m", "routetool", *[a.format(trace=trace) for a in template], "--no-progress"]
            wall = _timed(args, repeat)
            per_step = (wall - raw) / steps * 1e6
            print(f"{name:15} {cmd:18} {wall:8.2f} {raw:7.2f} {wall / raw:6.2f} {per_step:8.1f}")
            rows.append((name, cmd, wall, raw, steps, size_mib))
    if opts.csv:
        out = []
        for name, cmd, wall, raw, steps, size_mib in rows:
            case = f"{name} ({size_mib:.0f} MiB, {steps} steps) {cmd}"
            out.append([machine, "engine", case, "wall_s", f"{wall:.3f}", "s"])
            if cmd != "raw-read":
                out.append([machine, "engine", case, "ratio_to_raw_read", f"{wall / raw:.3f}", "x"])
                out.append([machine, "engine", case, "work_per_step_us", f"{(wall - raw) / steps * 1e6:.1f}", "us"])
        results.append(out, opts.csv)


if __name__ == "__main__":
    main()
