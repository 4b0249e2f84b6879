"""Writing output files safely: into a temporary file beside the target, then one rename.

A failed or interrupted write never leaves a half-written file at the target and never
damages a file that was there before.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from routetool.errors import RouteToolError


def default_file_mode() -> int:
    """``0o666`` less the process umask: the mode a plain ``open(path, "w")`` would give."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, suffix: str = ".tmp") -> Path:
    """Create ``path`` by calling ``write(tmp)`` on a temporary path in the same folder, then
    renaming it into place (with the mode a plain open would give).

    ``write`` may raise :class:`RouteToolError` (e.g. after validating what it wrote); the
    temporary file is removed on any failure.

    Raises:
        RouteToolError: the folder is not writable, the disk is full, or ``write`` failed.
    """
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=folder)
        os.close(fd)
    except OSError as exc:
        raise RouteToolError(f"cannot write in this folder ({exc.strerror or exc})", path=folder,
                             fix="choose a writable folder") from None
    try:
        try:
            write(tmp)
            os.chmod(tmp, default_file_mode())
            os.replace(tmp, path)
        except OSError as exc:
            raise RouteToolError(f"cannot write ({exc.strerror or exc})", path=path,
                                 fix="check free disk space and permissions") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
