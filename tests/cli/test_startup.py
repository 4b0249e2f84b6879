"""Fast start: --help, every subcommand's --help and usage errors never import torch or triton
(benchmarks/bench_startup.py measures the time; this checks the mechanism)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
from routetool.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "triton", "safetensors.torch") if m in sys.modules)
print("HEAVY", ",".join(heavy), file=sys.__stderr__)
"""


@pytest.mark.parametrize("args", [
    ["--help"],
    *[[c, "--help"] for c in ("replay", "validate", "balance", "bench", "synth", "info", "import", "capture")],
    ["replay", "missing.safetensors"],
    ["validate", "missing.safetensors", "--suite", "none"],
    ["balance", "missing.jsonl"],
    ["info", "missing.safetensors"],
    ["import", "missing.jsonl", "-o", "out.safetensors"],
    ["replay", "--no-such-option"],
])
def test_help_and_usage_errors_import_no_torch(tmp_path, args):
    res = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    heavy = [ln for ln in res.stderr.splitlines() if ln.startswith("HEAVY")]
    assert heavy == ["HEAVY "], res.stderr
