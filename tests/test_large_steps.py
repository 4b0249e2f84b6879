"""A step too large to hold (a sparse file declaring gigabytes of logits over a hole, a damaged
``step_offsets``) is refused before anything reads it, in one line with exit 2, by every command
that routes steps; per-row work (``info --scan``) reads any step in bounded pieces; an
allocation the input forces is bad input, never a kernel's crash or a traceback."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import routetool
from routetool.cli import main
from routetool.engine.stream import MAX_STEP_BYTES

ROOT = Path(routetool.__file__).resolve().parents[1]
TRACE_SMALL = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
E = 8


def sparse_trace(path: Path, rows: int, steps: int = 1, num_experts: int = E) -> Path:
    """A trace of one layer whose ``[rows, E]`` float32 logits are a hole in a sparse file (a few
    KB on disk however many gigabytes it declares), cut into ``steps`` equal steps."""
    offsets = struct.pack(f"<{steps + 1}q", *[rows * i // steps for i in range(steps + 1)])
    bias = struct.pack(f"<{num_experts}f", *([0.0] * num_experts))
    header = {
        "__metadata__": {"format": "routetool-trace", "format_version": "1", "num_layers": "1",
                         "num_experts": str(num_experts), "topk": "2", "route_scale": "1.0",
                         "router_score_normalization": "sigmoid", "model": "sparse", "provenance": "a test"},
        "layers.0.step_offsets": {"dtype": "I64", "shape": [steps + 1], "data_offsets": [0, len(offsets)]},
        "layers.0.bias": {"dtype": "F32", "shape": [num_experts],
                          "data_offsets": [len(offsets), len(offsets) + len(bias)]},
    }
    start = len(offsets) + len(bias)
    header["layers.0.gating_output"] = {"dtype": "F32", "shape": [rows, num_experts],
                                        "data_offsets": [start, start + 4 * rows * num_experts]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + offsets + bias)
        fh.truncate(8 + len(raw) + start + 4 * rows * num_experts)  # the logits: a hole
    return path


HUGE_ROWS = 16 * 2**20  # one step of 16M rows of 8 experts: 512 MiB declared, a few KB on disk


@pytest.mark.parametrize("command", [
    ["replay", "--no-latency", "--no-progress", "--device", "cpu"],
    ["balance", "--no-progress", "--device", "cpu"],  # (blamed the kernel: "crashed ... fix the kernel")
    ["balance", "--no-progress", "--device", "cpu", "--reference"],  # (8.1 GiB, or a traceback)
    ["validate", "--suite", "none", "--no-progress", "--device", "cpu"],
])
def test_a_step_too_large_to_hold_is_refused_before_it_is_read(tmp_path, command):
    path = sparse_trace(tmp_path / "t.safetensors", HUGE_ROWS)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # (sparse: the test itself holds nothing)
    res = CliRunner().invoke(main, [command[0], str(path), *command[1:]])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines == [f"routetool: error: {path}: layers.0.gating_output: step 0 holds 16,777,216 rows, 512.0 MiB of "
                     "8 experts' float32 scores, more than the 128.0 MiB one step may take (a step is routed, "
                     "compared and counted whole) (no forward pass routes that many tokens: check the layer's "
                     "step_offsets, or record smaller steps)"], res.stderr


def test_a_step_at_the_bound_is_read(tmp_path):
    rows = 4096
    path = sparse_trace(tmp_path / "t.safetensors", rows, steps=2)
    assert rows // 2 * 4 * E <= MAX_STEP_BYTES
    res = CliRunner().invoke(main, ["balance", str(path), "--no-progress", "--device", "cpu", "--reference"])
    assert res.exit_code == 0, res.output


_PEAK = """
import sys, threading, time
from routetool.cli import main

peak = [0]

def rss_anon():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("RssAnon:"))

def sample():
    while True:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.005)

threading.Thread(target=sample, daemon=True).start()
code = 1
try:
    code = main(sys.argv[1:], prog_name="routetool", standalone_mode=False)
finally:
    peak[0] = max(peak[0], rss_anon())
    print(peak[0], file=sys.stderr)
sys.exit(code if isinstance(code, int) else 0)
"""
"""Runs routetool in a process that reports its peak anonymous resident size (what it allocates;
the pages of a memory-mapped trace are the file's, which the system takes back)."""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from /proc")
def test_info_scan_reads_a_huge_step_in_bounded_pieces(tmp_path):
    # info --scan of a 2 GiB sparse layer took 2.3 GB: it read each step whole
    path = sparse_trace(tmp_path / "t.safetensors", 32 * 2**20)  # one step: 1 GiB of logits
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = subprocess.run([sys.executable, "-c", _PEAK, "info", str(TRACE_SMALL)], capture_output=True, text=True,
                          env=env, timeout=600)
    proc = subprocess.run([sys.executable, "-c", _PEAK, "info", str(path), "--scan", "--no-progress"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    added = int(proc.stderr.strip().splitlines()[-1]) - int(base.stderr.strip().splitlines()[-1])
    assert added < 512 << 20, f"info --scan of a 1 GiB step added {added / 2**20:.0f} MiB of anonymous memory"


def test_an_allocation_the_input_forces_is_bad_input_not_a_kernel_crash(tmp_path):
    # a kernel that runs out of memory on a large input was reported as "crashed ... fix the kernel"
    kernel = tmp_path / "k.py"
    kernel.write_text(
        "import torch\n"
        "def route(gating_output, bias, **kw):\n"
        "    raise RuntimeError('[enforce fail at alloc_cpu.cpp:119] DefaultCPUAllocator: can\\'t allocate memory: '\n"
        "                       'you tried to allocate 68719476736 bytes')\n")
    res = CliRunner().invoke(main, ["replay", str(TRACE_SMALL), "--kernel", f"{kernel}:route", "--no-latency",
                                    "--no-progress", "--device", "cpu"])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("routetool: error: cannot allocate the memory this input needs "
                                                   "(RuntimeError: [enforce fail"), res.stderr
    assert "fix the kernel" not in res.stderr


# -- a trace no command could read is not written --------------------------------------------
def test_synth_refuses_a_step_no_command_could_read(tmp_path):
    # synth wrote a 40,000-token prefill chunk of 1,024 experts (156 MiB of scores), which every
    # command reading the trace then refused
    out = tmp_path / "t.safetensors"
    res = CliRunner().invoke(main, ["synth", "-o", str(out), "--layers", "1", "--experts", "1024", "--prefill", "40000",
                                    "--decode-steps", "0", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("routetool: error: step 0 holds 40,000 rows, 156.2 MiB of 1,024 experts' float32 "
                                 "scores, more than the 128.0 MiB one step may take"), res.output
    assert "--prefill" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()


def test_an_import_of_a_step_no_command_could_read_is_refused(tmp_path, monkeypatch):
    # import wrote a trace that replay and balance then refused (balance reads an ids dump itself)
    import numpy as np

    import routetool.engine.stream as stream

    monkeypatch.setattr(stream, "MAX_STEP_BYTES", 1024)  # 64 rows of 2 int64 ids
    source = tmp_path / "request.npy"
    ids = np.stack([np.arange(65) % 8, (np.arange(65) + 1) % 8], axis=1)[:, None, :].astype(np.uint8)
    np.save(source, ids)
    out = tmp_path / "t.safetensors"
    res = CliRunner().invoke(main, ["import", str(source), "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"routetool: error: {source}: layer 0: step 0 holds 65 rows, 1.0 KiB of their ids, "
                                  "more than the 1.0 KiB one step may take (a step is routed, compared and counted "
                                  "whole) (no forward pass routes that many tokens: import the requests or workloads "
                                  "in smaller steps)"), res.output
    assert not out.exists()
