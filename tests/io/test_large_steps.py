"""Every per-row piece of work reads any step in bounded pieces (``info --scan``, the reference,
the comparison, histograms and per-step figures accumulated over a step's pieces), with outputs
identical to a step read whole; only a kernel under test is given a step whole, and a step too
large for that (a sparse file declaring gigabytes of logits over a hole, a damaged
``step_offsets``) is refused before anything reads it, in one line with exit 2; an allocation
the input forces is bad input, never a kernel's crash or a traceback."""

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
import routetool.engine.stream as stream
from routetool.engine.stream import DEFAULT_CHUNK_BYTES, KERNEL_STEP_BYTES

ROOT = Path(routetool.__file__).resolve().parents[1]
TRACE_SMALL = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
E = 8


@pytest.fixture
def sparse_trace(tmp_path):
    """``sparse_trace(rows, steps=1, num_experts=8) -> Path``: ``t.safetensors``, a trace of one layer
    whose ``[rows, E]`` float32 logits are a hole in a sparse file (a few KB on disk however many
    gigabytes it declares), cut into ``steps`` equal steps."""
    def make(rows: int, steps: int = 1, num_experts: int = E) -> Path:
        path = tmp_path / "t.safetensors"
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
    return make


HUGE_ROWS = 64 * 2**20  # one step of 64M rows of 8 experts: 2 GiB declared, a few KB on disk


@pytest.mark.parametrize("command", [
    ["replay", "--no-latency", "--no-progress", "--device", "cpu"],
    ["balance", "--no-progress", "--device", "cpu", "--kernel", "tiled"],  # (blamed the kernel: "crashed ...")
    ["validate", "--suite", "none", "--no-progress", "--device", "cpu"],
])
def test_a_step_too_large_for_a_kernel_is_refused_before_it_is_read(command, sparse_trace):
    path = sparse_trace(HUGE_ROWS)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # (sparse: the test itself holds nothing)
    assert HUGE_ROWS * 4 * E > KERNEL_STEP_BYTES
    res = CliRunner().invoke(main, [command[0], str(path), *command[1:]])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert lines == [f"routetool: error: {path}: layers.0.gating_output: step 0 holds 67,108,864 rows, 2.0 GiB of "
                     "8 experts' float32 scores, more than the 1.0 GiB a kernel under test is given whole (route it "
                     "with the reference, which reads any step in pieces (`routetool balance --reference`), or check "
                     "the layer's step_offsets)"], res.stderr


def test_a_step_at_the_kernel_bound_is_read(monkeypatch, sparse_trace):
    rows = 4096
    path = sparse_trace(rows, steps=2)
    monkeypatch.setattr(stream, "KERNEL_STEP_BYTES", rows // 2 * 4 * E)
    res = CliRunner().invoke(main, ["replay", str(path), "--no-latency", "--no-progress", "--device", "cpu"])
    assert res.exit_code == 0, res.output


# -- a step larger than the chunk, in pieces: the same outputs as the step read whole ---------
TRACE_PADDED = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"  # 256 experts, padding, steps of 32-384 rows


def _run(args: list[str], monkeypatch, budget: int) -> tuple[dict, int]:
    """The command's JSON with chunks of ``budget`` bytes, and the most rows one read took."""
    from routetool.io.trace import Trace

    monkeypatch.setattr(stream, "DEFAULT_CHUNK_BYTES", budget)
    most = [0]
    read_rows = Trace.read_rows

    def spy(self, layer, start, stop):
        most[0] = max(most[0], stop - start)
        return read_rows(self, layer, start, stop)

    monkeypatch.setattr(Trace, "read_rows", spy)
    res = CliRunner().invoke(main, [*args, "--json", "-", "--no-progress", "--device", "cpu"])
    assert res.exit_code in (0, 1), res.output
    return _untimed(json.loads(res.stdout)), most[0]


def _untimed(doc):
    """``doc`` without what the clock measures (seconds, rates)."""
    if isinstance(doc, dict):
        return {k: _untimed(v) for k, v in doc.items() if not k.endswith(("_s", "_per_s", "seconds", "_ms"))}
    if isinstance(doc, list):
        return [_untimed(v) for v in doc]
    return doc


def _same_in_pieces(args: list[str], monkeypatch, piece_rows: int, row_bytes: int, kernel: bool = False) -> None:
    whole, _ = _run(args, monkeypatch, DEFAULT_CHUNK_BYTES)
    pieces, most = _run(args, monkeypatch, piece_rows * row_bytes)
    if not kernel:  # (a kernel under test is given its steps whole)
        assert most <= piece_rows, f"a read of {most} rows, more than the chunk's {piece_rows}"
    assert json.dumps(pieces, sort_keys=True) == json.dumps(whole, sort_keys=True)


@pytest.mark.parametrize("trace", [TRACE_SMALL, TRACE_PADDED], ids=["tiny", "padded"])
@pytest.mark.parametrize("extra", [[], ["--recorded"]], ids=["reference", "recorded"])
def test_balance_reads_a_step_larger_than_the_chunk_in_pieces(tmp_path, monkeypatch, trace, extra):
    # balance --reference held each step whole (and refused one over 128 MiB): a step of 384 rows
    # read in pieces of 24 gives the same JSON as the step read whole
    if extra and trace == TRACE_PADDED:
        pytest.skip("the padded trace holds no recorded ids")
    args = ["balance", str(trace), *(extra or ["--reference"]), "--ep-size", "8", "--windows", "3"]
    _same_in_pieces(args, monkeypatch, 24, 4 * 256)


def test_balance_of_an_ids_only_trace_reads_a_step_in_pieces(copy_trace, monkeypatch):
    # the small trace without its logits: an ids-only trace of its recorded ids
    path = copy_trace(TRACE_SMALL, "ids.safetensors", keep=lambda name: not name.endswith("gating_output"))
    _same_in_pieces(["balance", str(path), "--ep-size", "8"], monkeypatch, 24, 8 * 8)


def test_balance_of_a_run_folder_adds_the_ranks_pieces_step_by_step(tmp_path, monkeypatch):
    # one rank's step in pieces, another's whole beside it: the global step is their sum
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["synth", "-o", str(run), "--ranks", "2", "--layers", "2", "--experts", "16",
                                    "--topk", "2", "--prefill", "96,40", "--decode-steps", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    _same_in_pieces(["balance", str(run), "--reference", "--ep-size", "4"], monkeypatch, 30, 4 * 16)


def test_replay_and_validate_route_whole_steps_and_check_them_in_pieces(tmp_path, monkeypatch):
    # the kernel sees each captured step whole; the comparison runs over pieces of the chunk
    path = tmp_path / "t.safetensors"
    res = CliRunner().invoke(main, ["synth", "-o", str(path), "--layers", "1", "--experts", "16", "--topk", "2",
                                    "--prefill", "200", "--decode-steps", "3", "--dtype", "float32", "--no-progress"])
    assert res.exit_code == 0, res.output
    shapes = []
    import routetool.engine.contract as contract
    import routetool.engine.router as router_mod

    call_kernel = contract.call_kernel

    def spy(fn, gating_output, *args, **kw):
        shapes.append(gating_output.shape[0])
        return call_kernel(fn, gating_output, *args, **kw)

    monkeypatch.setattr(router_mod, "call_kernel", spy)
    whole, _ = _run(["replay", str(path), "--no-latency"], monkeypatch, DEFAULT_CHUNK_BYTES)
    calls, shapes[:] = list(shapes), []
    pieces, _ = _run(["replay", str(path), "--no-latency"], monkeypatch, 24 * 4 * 16)
    assert shapes == calls and max(shapes) == 200  # every step given to the kernel whole
    assert json.dumps(pieces, sort_keys=True) == json.dumps(whole, sort_keys=True)
    _same_in_pieces(["validate", str(path), "--suite", "none"], monkeypatch, 24, 4 * 16, kernel=True)


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
def test_info_scan_reads_a_huge_step_in_bounded_pieces(sparse_trace):
    # info --scan of a 2 GiB sparse layer took 2.3 GB: it read each step whole
    path = sparse_trace(32 * 2**20)  # one step: 1 GiB of logits
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
def test_synth_refuses_a_step_no_kernel_could_be_given(tmp_path, monkeypatch):
    # synth wrote a 40,000-token prefill chunk of 1,024 experts (156 MiB of scores) that replay,
    # validate and balance then refused; the kernel's bound is lowered here under that step
    monkeypatch.setattr(stream, "KERNEL_STEP_BYTES", 128 << 20)
    out = tmp_path / "t.safetensors"
    res = CliRunner().invoke(main, ["synth", "-o", str(out), "--layers", "1", "--experts", "1024", "--prefill", "40000",
                                    "--decode-steps", "0", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("routetool: error: step 0 holds 40,000 rows, 156.2 MiB of 1,024 experts' float32 "
                                 "scores, more than the 128.0 MiB a kernel under test is given whole"), res.output
    assert "--prefill" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not out.exists()


def test_an_import_of_ids_takes_any_step(tmp_path, monkeypatch):
    # import refused an ids step over the readers' old bound; ids are read in pieces, whatever a step's size
    import numpy as np

    monkeypatch.setattr(stream, "KERNEL_STEP_BYTES", 1024)  # 64 rows of 2 int64 ids, were they bounded
    source = tmp_path / "request.npy"
    ids = np.stack([np.arange(65) % 8, (np.arange(65) + 1) % 8], axis=1)[:, None, :].astype(np.uint8)
    np.save(source, ids)
    out = tmp_path / "t.safetensors"
    res = CliRunner().invoke(main, ["import", str(source), "-o", str(out)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["balance", str(out), "--no-progress", "--device", "cpu"])
    assert res.exit_code == 0, res.output
