"""Whole-process time of ``routetool diff T T`` against a raw read of both sources.

Makes a synthetic trace with ``routetool synth`` (the traces of ``bench_engine.py``), then times,
each as a whole Python process (start-up, imports and the reads included) and in the same run:

* the raw read of both sources: every tensor of the traces read with safetensors and moved to
  the device (what any diff must at least do);
* ``routetool diff T T`` (with ``--json``): a trace against itself. Both sides hold the same
  logits, so the reference routes each chunk once (``RouteMemo``) and every piece is identical
  (the answer ``IDENTICAL`` costs comparing the pieces);
* ``routetool diff T T2``: T against a twin of the same steps whose logits and bias differ
  (``synth --bias-rate 0.002``), so that the reference routes both sides and most rows take
  the full comparison, near-tie margins included: the work of a diff that finds differences.

It prints, per trace, the best of ``--repeat`` runs, the ratio to the raw read and the work per
captured step beyond the read, and appends one row per measurement to the results CSV (the
format of ``bench_engine.py``). ``diff`` routes and compares on the CPU unless ``--device cuda``.

    python benchmarks/bench_diff.py --set cpu       # a 2-core CPU: the small decode trace
    python benchmarks/bench_diff.py --set gpu       # an H200: decode- and prefill-heavy traces
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine  # noqa: E402 - the traces, the timing and the machine line of the engine benchmark
import results  # noqa: E402 - benchmarks/results.py, the one results file

RAW_READ_BOTH = """
import sys, torch
from safetensors import safe_open
device = sys.argv[-1]
for path in sys.argv[1:-1]:
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            f.get_tensor(name).to(device)
if device == "cuda":
    torch.cuda.synchronize()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(bench_engine.TRACES), default="cpu", help="which traces (default cpu)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement, best kept (default 3)")
    ap.add_argument("--workdir", default=None, help="where the traces go (default a temporary folder)")
    ap.add_argument("--csv", default=str(results.RESULTS), help="results file to append to ('' for none)")
    opts = ap.parse_args()
    device = "cuda" if opts.set == "gpu" else "cpu"
    work = Path(opts.workdir or tempfile.mkdtemp(prefix="routetool-diff-"))
    work.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    machine = bench_engine._machine(device)
    rows = []
    print(f"commit {results.commit()}, {machine}, best of {opts.repeat}")
    print(f"{'trace':15} {'command':12} {'wall s':>8} {'raw s':>7} {'x raw':>6} {'us/step':>8}")
    for name, synth_args in bench_engine.TRACES[opts.set].items():
        trace, twin = work / f"{name}.safetensors", work / f"{name}-twin.safetensors"
        for path, extra in ((trace, []), (twin, ["--bias-rate", "0.002"])):
            if not path.exists():
                subprocess.run([py, "-m", "routetool", "synth", *synth_args, *extra, "-o", str(path), "--no-progress"],
                               env=bench_engine._env(), check=True, stdout=subprocess.DEVNULL)
        steps = bench_engine._steps(trace)
        for label, other in (("self", trace), ("twin", twin)):
            size_mib = (trace.stat().st_size + other.stat().st_size) / 2**20
            raw = bench_engine._timed([py, "-c", RAW_READ_BOTH, str(trace), str(other), device], opts.repeat)
            wall = bench_engine._timed([py, "-m", "routetool", "diff", str(trace), str(other), "--device", device,
                                        "--json", str(work / "diff.json"), "--force", "--no-progress"], opts.repeat)
            per_step = (wall - raw) / steps * 1e6
            command = "diff T T" if label == "self" else "diff T T2"
            print(f"{name:15} {'raw read x2':12} {raw:8.2f} {raw:7.2f} {1.0:6.2f} {'':>8}   ({size_mib:.0f} MiB "
                  f"read, {steps:,} steps)")
            print(f"{name:15} {command:12} {wall:8.2f} {raw:7.2f} {wall / raw:6.2f} {per_step:8.1f}")
            rows.append((name, label, steps, size_mib, raw, wall))
    if opts.csv:
        out = []
        for name, label, steps, size_mib, raw, wall in rows:
            case = f"{name} ({size_mib:.0f} MiB, {steps} steps) diff-{label}"
            out.append([machine, "diff", f"{case} raw-read-x2", "wall_s", f"{raw:.3f}", "s"])
            out.append([machine, "diff", case, "wall_s", f"{wall:.3f}", "s"])
            out.append([machine, "diff", case, "ratio_to_raw_read", f"{wall / raw:.3f}", "x"])
            out.append([machine, "diff", case, "work_per_step_us", f"{(wall - raw) / steps * 1e6:.1f}", "us"])
        results.append(out, opts.csv)


if __name__ == "__main__":
    main()
