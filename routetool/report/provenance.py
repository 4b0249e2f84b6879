"""Where a report came from, beside what its JSON document says of the run: routetool's version
and source commit, the versions of the libraries it ran with, and the machine.

Read without importing the libraries (their installed metadata) and without the network. The
host and user names are left out: the report is meant to be attached to a public issue.
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import routetool

LIBRARIES = ("torch", "triton", "numpy", "safetensors", "click", "rich", "matplotlib")
"""The distributions whose versions a report names (``not installed`` where absent)."""


def library_versions() -> dict[str, str]:
    """Python's and each of :data:`LIBRARIES`' installed version, e.g. ``{"python": "3.12.3
    (CPython)", "torch": "2.13.0+cpu", "matplotlib": "not installed"}``."""
    versions = {"python": f"{platform.python_version()} ({platform.python_implementation()})"}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def source_commit() -> str | None:
    """The git commit of the checkout routetool runs from, ``+ local changes`` when tracked files
    differ from it; None when routetool is not run from a git checkout of its own (an installed
    wheel), or git is missing or does not answer within 10 s."""
    root = Path(routetool.__file__).resolve().parent.parent
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None  # (a site-packages folder inside some other repository names that repository's commit)

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changes = git("status", "--porcelain", "--untracked-files=no")
    return commit + (" + local changes" if changes else "")


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what :func:`platform.processor` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, str]:
    """The machine, without its host name: ``{"os": ..., "cpu": "MODEL, N cores", "architecture": ...}``
    (the GPU a run used is in its document's ``execution``)."""
    return {"os": platform.platform(), "cpu": f"{_cpu_model()}, {os.cpu_count() or '?'} logical cores",
            "architecture": platform.machine() or "unknown"}


def provenance(command: str | None) -> dict[str, str]:
    """Every fact of the report's "Run" section, in order: ``command`` (the command line as run),
    when (UTC), routetool's version and commit, the libraries' versions, the machine."""
    facts = {"command": command or "-",
             "written": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
             "routetool": routetool.__version__,
             "commit": source_commit() or "unknown (not run from a git checkout)"}
    facts.update(library_versions())
    facts.update(machine())
    return facts
