"""A torchrun job whose process dies while the others wait for it in a collective: the survivor
ends in one line, printed once for the job, not in the backend's (gloo's) traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import routetool
from routetool.cli import main

ROOT = Path(routetool.__file__).resolve().parents[1]

# The torchrun entry: routetool, with process 0 killed (os._exit) as it reaches the gather of the
# results, two seconds after process 1 has entered it and waits.
_DIES_AT_THE_GATHER = """
import os, sys, time
import torch.distributed as dist

real_gather = dist.all_gather_object

def gather(*args, **kwargs):
    if os.environ["RANK"] == "0":
        time.sleep(2)
        os._exit(9)
    return real_gather(*args, **kwargs)

dist.all_gather_object = gather
from routetool.cli import main
main(sys.argv[1:], prog_name="routetool")
"""


@pytest.mark.parametrize("command", [["replay", "--no-latency"], ["balance"]])
def test_a_process_that_dies_leaves_one_line_not_a_traceback(tmp_path, command):
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["synth", "-o", str(run), "--ranks", "2", "--layers", "2", "--experts", "8",
                                    "--topk", "2", "--prefill", "16", "--decode-steps", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    entry = tmp_path / "entry.py"
    entry.write_text(_DIES_AT_THE_GATHER)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # (--monitor-interval 5: torchrun notices the dead process, and stops the others, after the
    # survivor has met the loss itself)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--monitor-interval", "5", str(entry), command[0], str(run), *command[1:], "--device",
                           "cpu", "--no-progress"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("routetool:")]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert ours[0].startswith("routetool: error: another process of this torchrun job stopped while the processes "
                              "gathered their results ("), ours
    # no worker's traceback: the one traceback left is torchrun's own launcher's (its ChildFailedError
    # report of the process that died), with frames of torch.distributed only
    frames = [line for line in proc.stderr.splitlines() if line.lstrip().startswith('File "')]
    assert proc.stderr.count("Traceback (most recent call last)") <= 1, proc.stderr[-3000:]
    assert all("torch/distributed" in f or "<frozen runpy>" in f for f in frames), frames
    assert "gloo" not in proc.stderr.replace(ours[0], ""), proc.stderr[-3000:]
