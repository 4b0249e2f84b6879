"""What an install puts into site-packages: routetool and routetool_kernels (the folder kernel/),
never a top-level module named ``kernel``."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"routetool." + p.parent.name for p in (ROOT / "routetool").glob("*/__init__.py")} | {"routetool"}
    assert set(config["packages"]) == folders | {"routetool_kernels"}
    assert config["package-dir"] == {"routetool_kernels": "kernel"}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git to copy the tracked files")
def test_the_wheel_holds_no_module_named_kernel(tmp_path):
    src = tmp_path / "src"
    # a copy of the tracked files, so that the build leaves nothing in the checkout
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "pyproject.toml", "README.md", "routetool", "kernel"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    try:  # the build backend of this environment, or pip's isolated one (a fresh venv has no setuptools)
        import setuptools  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, str(src),
                           "-w", str(tmp_path / "dist")], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"pip wheel is not available here: {done.stderr.strip().splitlines()[-1:]}")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"routetool", "routetool_kernels"}
    assert "routetool_kernels/spec.py" in zipfile.ZipFile(wheel).namelist()
