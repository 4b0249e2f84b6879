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
    time.sleep(600)

routetool.io.trace.save_file = save_then_pause
main(sys.argv[2:], prog_name="routetool")
"""


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _routetool(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "routetool", *map(str, args)], env=_env(), text=True, **kwargs)


def _signal_when_ready(proc, ready, signum, not_reached, paused_check=None) -> str:
    """Wait (a hang guard, generous for a loaded machine) until ``proc`` makes the file ``ready``,
    send it ``signum`` and return its stderr; ``paused_check()`` must be true while it waits there."""
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else not_reached
        if paused_check is not None:
            assert paused_check(), "the temporary file should exist while the write is paused"
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return err


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
    err = _signal_when_ready(proc, ready, signum, "the write never started", lambda: [p.name for p in out_dir.iterdir()])
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


# -- outputs are created exclusively; a run folder is published whole; SIGTERM is 143 throughout ----
# Runs `routetool ARGS...` with every output check followed by a barrier: the process writes
# READY-<id>, then waits until the other process has written its own, so that both have checked
# their outputs (nothing there yet) before either writes.
_AFTER_CHECK_BARRIER = """
import sys, time
from pathlib import Path
import routetool.io.inputs as inputs

folder, me = Path(sys.argv[1]), sys.argv[2]
real_check = inputs.check_output_paths

def check_then_wait(*args, **kwargs):
    real_check(*args, **kwargs)
    (folder / f"ready-{me}").touch()
    deadline = time.monotonic() + 300
    while len(list(folder.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)

inputs.check_output_paths = check_then_wait
from routetool.cli import main
main(sys.argv[3:], prog_name="routetool")
"""


@pytest.mark.parametrize("kind", ["json", "trace"])
def test_two_runs_writing_one_output_without_force_never_both_succeed(tmp_path, kind):
    # the existence check and the rename were two steps: both runs passed the check, both renamed
    # their file into place, both exited 0, and one run's output was silently lost
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    out = tmp_path / ("out.json" if kind == "json" else "out.safetensors")
    if kind == "json":
        args = ["info", TRACE, "--json", out]
    else:
        args = ["synth", "-o", out, "--layers", "1", "--experts", "8", "--topk", "2", "--prefill", "16",
                "--decode-steps", "2", "--no-progress"]
    procs = [subprocess.Popen([sys.executable, "-c", _AFTER_CHECK_BARRIER, str(barrier), str(i), *map(str, args)],
                              env=_env(), text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for i in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], errs
    loser = errs[[p.returncode for p in procs].index(2)]
    lines = loser.splitlines()  # (the trace writer's own check may see the winner's file first)
    assert len(lines) == 1 and lines[0].startswith(f"routetool: error: {out}: already exists"), loser
    assert lines[0].endswith("(choose another path or pass --force to replace it)"), loser
    assert sorted(p.name for p in tmp_path.iterdir()) == ["barrier", out.name]  # no temporary file left


_SYNTH_ARGS = ["--layers", "1", "--experts", "8", "--topk", "2", "--prefill", "16", "--decode-steps", "2",
               "--no-progress"]

# Runs `routetool ARGS...` with the trace writer paused after its second trace: writes READY, then sleeps.
_PAUSED_AFTER_TWO = """
import sys, time
from pathlib import Path
import routetool.io.trace
from routetool.cli import main

real_save_file = routetool.io.trace.save_file
written = []

def save_then_pause(*args, **kwargs):
    real_save_file(*args, **kwargs)
    written.append(1)
    if len(written) == 2:
        Path(sys.argv[1]).touch()
        time.sleep(300)

routetool.io.trace.save_file = save_then_pause
main(sys.argv[2:], prog_name="routetool")
"""


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_killed_synth_ranks_leaves_the_old_run_folder_whole(tmp_path):
    # a SIGKILL after two of three ranks left rank-0 and rank-1 new and rank-2 old, a run folder
    # that `info` read with exit 0
    run = tmp_path / "run"
    assert subprocess.run([sys.executable, "-m", "routetool", "synth", "-o", str(run), "--ranks", "3", *_SYNTH_ARGS],
                          env=_env(), capture_output=True, timeout=600).returncode == 0
    before = _files(run)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_AFTER_TWO, str(ready), "synth", "-o", str(run), "--ranks",
                             "3", "--seed", "1", "--force", *_SYNTH_ARGS], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), "the writer never reached its second trace"
        proc.kill()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _files(run) == before  # the old run, whole: the new ranks were written aside
    # and the same run finished replaces it whole
    done = subprocess.run([sys.executable, "-m", "routetool", "synth", "-o", str(run), "--ranks", "3", "--seed", "1",
                           "--force", *_SYNTH_ARGS], env=_env(), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr
    after = _files(run)
    assert sorted(after) == sorted(before) and all(after[k] != before[k] for k in after)


# Runs `python -m routetool ARGS...` paused at POINT: `import` (while the command group is imported,
# before any command runs) or `exit` (the report written, on the way out): writes READY, then sleeps.
_PAUSED_AT = """
import runpy, sys, time
from pathlib import Path

ready, point = Path(sys.argv[1]), sys.argv[2]

class PauseAtClick:
    def find_spec(self, name, path=None, target=None):
        if point == "import" and name == "click":
            ready.touch()
            time.sleep(300)
        return None

sys.meta_path.insert(0, PauseAtClick())
if point == "teardown":  # freed in the interpreter's teardown, where no Python signal handler runs

    import types

    class PauseWhenFreed:
        def __del__(self, touch=ready.touch, sleep=time.sleep):  # (the globals may be gone by then)
            touch()
            sleep(300)

    sys.modules["freed_at_teardown"] = types.ModuleType("freed_at_teardown")
    sys.modules["freed_at_teardown"].pause = PauseWhenFreed()
if point == "exit":
    real_exit = sys.exit

    def paused_exit(code=0):
        ready.touch()
        time.sleep(300)
        real_exit(code)

    sys.exit = paused_exit
sys.argv = ["routetool", *sys.argv[3:]]
runpy.run_module("routetool", run_name="__main__")
"""


def test_the_process_ends_without_the_interpreters_teardown(tmp_path):
    # a signal in the interpreter's teardown (about 0.4 s after every report, with torch loaded) met
    # the default action: exit -15 or -2 after the report was written
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_AT, str(ready), "teardown", "info", str(TRACE)], env=_env(),
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if ready.exists():
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and not ready.exists(), (proc.returncode, err)


@pytest.mark.parametrize("point", ["import", "exit"])
@pytest.mark.parametrize("signum, code, line", [
    (signal.SIGTERM, 143, "routetool: terminated by SIGTERM"),
    # Ctrl-C there was Python's KeyboardInterrupt traceback and a process killed by SIGINT (-2)
    (signal.SIGINT, 130, "routetool: aborted"),
])
def test_a_signal_at_start_up_or_on_the_way_out_exits_with_its_code(tmp_path, point, signum, code, line):
    # SIGTERM before the command group had installed its handler, or after it had restored the
    # default one, killed the process: exit -15 and no line
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_AT, str(ready), point, "info", str(TRACE)], env=_env(),
                            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # (as on a terminal)
    err = _signal_when_ready(proc, ready, signum, "never reached")
    assert proc.returncode == code, err
    assert err.splitlines() == [line], err


# Runs `routetool ARGS...` through the entry point and reports OMP_WAIT_POLICY as torch is first imported.
_POLICY_AT_TORCH = """
import atexit, importlib.abc, os, sys

seen = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))

sys.meta_path.insert(0, Watch())
atexit.register(lambda: print("POLICY", *seen, file=sys.stderr))
sys.argv = ["routetool", *sys.argv[1:]]
from routetool.__main__ import main
main()
"""


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_sleep_between_operations_unless_told_otherwise(given, expected):
    # the CPU work is many short operations: on shared cores, threads spinning between them cost 2.5x-3x
    # (routetool/__main__.py); the policy must be in the environment before torch loads OpenMP
    env = _env()
    env.pop("OMP_WAIT_POLICY", None)
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    res = subprocess.run([sys.executable, "-c", _POLICY_AT_TORCH, "info", str(TRACE)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"POLICY {expected}" in res.stderr.splitlines(), res.stderr
