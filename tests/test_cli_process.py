"""`python -m routetool` as a process: signals (Ctrl-C, SIGTERM), a closed output pipe, and what
reaches stderr. Run in subprocesses, because signal handlers, exit codes and the interpreter's
flush at exit are what is tested."""

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import routetool

ROOT = Path(routetool.__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"

# Runs `routetool ARGS...` with the trace writer paused right after safetensors wrote the
# temporary file (the point where a large trace spends its time): writes READY, then sleeps.
_PAUSED_WRITER = """
import sys, time
from pathlib import Path
import routetool.io.trace
from routetool.cli import main

real_save_file = routetool.io.trace.save_file

def save_then_pause(*args, **kwargs):
    real_save_file(*args, **kwargs)
    Path(sys.argv[1]).touch()
    time.sleep(120)

routetool.io.trace.save_file = save_then_pause
main(sys.argv[2:], prog_name="routetool")
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _routetool(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "routetool", *map(str, args)], env=_env(), text=True, **kwargs)


@pytest.mark.parametrize("signum, code, message", [
    (signal.SIGTERM, 143, "routetool: terminated by SIGTERM"),
    (signal.SIGINT, 130, "routetool: aborted"),
])
def test_a_signal_during_a_write_leaves_no_file_behind(tmp_path, signum, code, message):
    # SIGTERM (timeout, schedulers, CI) used to kill routetool at once: exit -15, the hidden
    # temporary files of the write left beside the output
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_WRITER, str(ready), "synth", "-o", str(out_dir / "t.safetensors"),
         "--layers", "1", "--experts", "8", "--topk", "2", "--prefill", "16", "--decode-steps", "2", "--no-progress"],
        env=_env(), text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "the write never started"
        assert [p.name for p in out_dir.iterdir()], "the temporary file should exist while the write is paused"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, err
    assert list(out_dir.iterdir()) == []  # neither the output nor a temporary file
    assert err.splitlines() == [message]  # one line: no empty line before it (click writes one on Ctrl-C)
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [
    ["replay", TRACE, "--no-progress"],  # rich writes the tables
    ["replay", TRACE, "--no-progress", "--json", "-"],  # the JSON document (tables on stderr)
    ["--help"],  # click writes it, before any command runs
])
def test_a_closed_output_pipe_exits_141_not_1(args):
    # `routetool replay TRACE | head -1` used to exit 1, the code for "the check found a problem"
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails
    try:
        proc = _routetool(*args, stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err and "BrokenPipeError" not in err


def test_a_pickle_dump_is_refused_in_one_line_without_torch_warnings(tmp_path):
    # torch.load warned about the pickle protocol (two lines naming a site-packages file)
    # before routetool's one-line error
    dump = tmp_path / "e.pt"
    dump.write_bytes(pickle.dumps(os.getcwd, protocol=4))  # a pickle torch's weights_only loader refuses
    proc = _routetool("import", dump, "-o", tmp_path / "e.safetensors", stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"routetool: error: {dump}: cannot load with torch.load"), err
    assert not (tmp_path / "e.safetensors").exists()
