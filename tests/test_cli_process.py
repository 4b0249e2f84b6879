"""`python -m routetool` as a process: what reaches stderr. Run in subprocesses, because what a
library prints there (warnings) is what is tested."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import routetool

ROOT = Path(routetool.__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _routetool(*args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "routetool", *map(str, args)], env=_env(), text=True, **kwargs)


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
