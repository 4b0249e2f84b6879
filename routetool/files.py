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


def refuse_special_file(path: str | os.PathLike, *, fix: str) -> None:
    """Refuse an input path that exists but is neither a regular file nor a folder (a FIFO, a
    device, a socket, or a link to one), before anything opens it: reading one could block
    forever, and its name says nothing about what it holds.

    A missing path or a folder is left to the reader, which names them.

    Raises:
        RouteToolError: naming the path and ``fix``.
    """
    p = Path(path)
    if p.exists() and not p.is_file() and not p.is_dir():
        raise RouteToolError("is not a regular file (a FIFO, device or socket); reading it could block", path=p,
                             fix=fix)


def missing_folders(path: str | os.PathLike) -> tuple[Path, list[Path]]:
    """``path``'s nearest ancestor (or ``path`` itself) that is there, a dangling link included,
    and the paths below it that are not, innermost first (``path`` first when it is missing)."""
    existing, missing = Path(path), []
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        missing.append(existing)
        existing = existing.parent
    return existing, missing


def check_output_folder(folder: str | os.PathLike) -> None:
    """Refuse an output's folder that is not there: missing, or a file (or a link to nothing)
    where a folder belongs, itself or one of its parents (``notes.txt/out.json``).

    The one check of an output's folder, for every command and writer: the message names the
    path that is in the way, with the fix.

    Raises:
        RouteToolError: ``is a file, not a folder`` / ``is a link to a missing path, not a
            folder`` naming that path, or ``folder does not exist`` naming ``folder``.
    """
    folder = Path(folder) if str(folder) else Path(".")
    if folder.is_dir():
        return
    blocker, _ = missing_folders(folder)
    if blocker.is_symlink() and not blocker.exists():
        raise RouteToolError("is a link to a missing path, not a folder", path=blocker,
                             fix="choose another output path, or make the link point to a folder")
    if blocker.exists() and not blocker.is_dir():
        kind = "a file" if blocker.is_file() else "a FIFO, device or socket"
        raise RouteToolError(f"is {kind}, not a folder", path=blocker,
                             fix="choose another output path")
    raise RouteToolError("folder does not exist", path=folder, fix="create it first")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output_paths(outputs, *, force: bool, inputs=(), allow_stdout: bool = True) -> None:
    """Fail before any work when an output cannot be written or would destroy data.

    Args:
        outputs: output paths (None entries are ignored; ``-`` means stdout when allowed).
        force: allow replacing existing files (never an input, never twice in one run).
        inputs: the run's input paths (a sharded trace's index stands for its shard files
            too, a folder for the files directly in it); no output may be one of them.
        allow_stdout: whether ``-`` is accepted.

    Raises:
        RouteToolError: ``-`` where a file is needed; two outputs naming the same file; an
            output that is an input or an existing file of an input folder; an existing file
            (or link) without ``force``; a directory; a FIFO, device or socket; a missing or
            unwritable folder (probed by creating a temporary file), or a file where a folder
            belongs (:func:`check_output_folder`).
    """
    from routetool.sharded import listed_shard_files  # (sharded imports this module)

    protected = [Path(i) for i in inputs if i is not None and str(i) != "-"]
    protected += [shard for i in list(protected) for shard in listed_shard_files(i)]
    seen: list[Path] = []
    for out in outputs:
        if out is None:
            continue
        if str(out) == "-":
            if not allow_stdout:
                raise RouteToolError("'-' (stdout) cannot take this output", path="-", fix="name a file")
            continue
        p = Path(out)
        for other in seen:
            if _same_file(p, other):
                raise RouteToolError("is named for two outputs of one run", path=p, fix="give each output its own file")
        seen.append(p)
        for inp in protected:
            if inp.is_dir() and (p.exists() or p.is_symlink()) and _same_file(p.parent, inp):
                raise RouteToolError("is a file in this run's input folder; writing the output there would replace "
                                     "it", path=p, fix="choose another output path")
            if _same_file(p, inp):
                raise RouteToolError("is this run's input; writing the output there would destroy it", path=p,
                                     fix="choose another output path")
        if p.is_dir():
            raise RouteToolError("is a directory", path=p, fix="name a file")
        if p.exists() and not p.is_file():  # a FIFO, device or socket (or a link to one): never replaced
            raise RouteToolError("is not a regular file (a FIFO, device or socket)", path=p,
                                 fix="name a regular file, or - for stdout")
        if (p.exists() or p.is_symlink()) and not force:  # (a dangling link too)
            raise RouteToolError("already exists", path=p, fix="choose another path or pass --force to replace it")
        folder = p.parent if str(p.parent) else Path(".")
        check_output_folder(folder)
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise RouteToolError(f"folder is not writable ({exc.strerror or exc})", path=folder,
                                 fix="choose a writable folder") from None
