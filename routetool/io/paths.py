"""Paths: what is at one (the one check every path goes through), and writing outputs safely.

:func:`path_kind` is how routetool asks the system about any path it is given or reads from a
file (inputs, outputs, an index's shards, the folders above an output); :func:`resolved` and
:func:`same_file` compare paths. A path the system cannot examine (a loop of symbolic links, a
NUL byte, a name too long, a folder that cannot be searched) is a one-line
:class:`~routetool.errors.RouteToolError` there, never an ``OSError``, ``RuntimeError`` or
``ValueError`` further on.

Outputs are written into a temporary file beside the target, then published: a failed or
interrupted write never leaves a half-written file at the target and never damages a file
that was there before. An output the run's check cleared without ``--force`` is published only
if it is still absent (:func:`rename_noreplace`: the check and the publication are not two
steps another run can come between), so two runs writing one output never both succeed. The
check of a command's outputs before any work is :func:`routetool.io.inputs.check_output_paths`
(it knows what an input protects: an index's shards, a run folder's ranks).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from routetool.errors import RouteToolError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """``0o666`` less the process umask: the mode a plain ``open(path, "w")`` would give."""
    return 0o666 & ~_umask()


_EXCLUSIVE: set[str] = set()
"""Outputs of the running command that its check cleared without ``--force`` (absolute paths):
:func:`atomic_write` publishes them only if they are still absent. Emptied when a command starts."""


def claim_outputs(paths, *, force: bool) -> None:
    """Record how the running command may publish ``paths`` (its outputs, once checked): without
    ``force``, only where nothing stands at publication (:func:`atomic_write`); with it, replacing."""
    for p in paths:
        if p is None or str(p) == "-":
            continue
        key = os.path.abspath(p)
        if force:
            _EXCLUSIVE.discard(key)
        else:
            _EXCLUSIVE.add(key)


def forget_claims() -> None:
    """Forget the outputs claimed by :func:`claim_outputs` (a new command starts)."""
    _EXCLUSIVE.clear()


_RENAME_NOREPLACE = 1  # renameat2's flag (linux/fs.h)


def _renameat2(src: str, dst: str) -> bool | None:
    """Linux's ``renameat2(RENAME_NOREPLACE)``: True when renamed, None when the system or file
    system cannot do it. Raises ``FileExistsError`` when ``dst`` exists, ``OSError`` otherwise."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.renameat2
    except (OSError, AttributeError, ImportError):
        return None
    at_cwd = -100
    if call(at_cwd, os.fsencode(src), at_cwd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # (EINVAL: a file system without the flag)
        return None
    raise OSError(err, os.strerror(err), dst) if err != errno.EEXIST else FileExistsError(err, os.strerror(err), dst)


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` (a file or a folder) to ``dst`` only if nothing is at ``dst``, in one step
    of the file system: ``renameat2(RENAME_NOREPLACE)`` on Linux; elsewhere a hard link and the
    removal of ``src`` for a file (``link`` fails where the name exists), and for a folder a
    rename after a check (the one case with a window, where neither is available).

    Raises:
        FileExistsError: something is at ``dst``. OSError: the rename failed otherwise.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    if _renameat2(src, dst):
        return
    if os.path.isdir(src):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)
        return
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError as exc:  # a file system without hard links
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP):
            raise
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst) from None
        os.rename(src, dst)
        return
    os.unlink(src)


def _already_written(path: Path) -> RouteToolError:
    return RouteToolError("already exists: another run wrote it after this run checked its outputs", path=path,
                          fix="choose another path or pass --force to replace it")


def atomic_write(path: str | os.PathLike, write: Callable[[str], None], *, suffix: str = ".tmp",
                 replace: bool | None = None) -> Path:
    """Create ``path`` by calling ``write(tmp)`` on a temporary path in the same folder, then
    publishing it under ``path`` (with the mode a plain open would give).

    ``write`` may raise :class:`RouteToolError` (e.g. after validating what it wrote); the
    temporary file is removed on any failure.

    Args:
        replace: True: replace what is at ``path``; False: publish only if nothing is there
            (:func:`rename_noreplace`); None: False for an output the running command claimed
            without ``--force`` (:func:`claim_outputs`), True otherwise.

    Raises:
        RouteToolError: the folder is not writable, the disk is full, ``write`` failed, or
            (without ``replace``) a file appeared at ``path`` since the output was checked.
    """
    path = Path(path)
    if replace is None:
        replace = os.path.abspath(path) not in _EXCLUSIVE
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
            if replace:
                os.replace(tmp, path)
            else:
                rename_noreplace(tmp, path)
        except FileExistsError:
            raise _already_written(path) from None
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


def staged_folder(path: str | os.PathLike) -> Path:
    """A new empty hidden folder beside ``path`` (``.NAME.XXXXXXXX.tmp``), in which a folder
    output is written before :func:`publish_folder` renames it whole into place.

    Raises:
        RouteToolError: the folder above ``path`` is not writable.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        staged = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
        os.chmod(staged, 0o777 & ~_umask())  # (mkdtemp's 0o700: the mode a plain mkdir gives)
        return staged
    except OSError as exc:
        raise RouteToolError(f"cannot write in this folder ({exc.strerror or exc})", path=parent,
                             fix="choose a writable folder") from None


def publish_folder(staged: str | os.PathLike, path: str | os.PathLike, *, replace: bool) -> None:
    """Rename the folder ``staged`` (:func:`staged_folder`) to ``path`` whole, so that a run
    killed at any moment leaves either the old folder or the new one at ``path``, never a mix.

    Nothing at ``path``, or an empty folder: ``staged`` takes its place (only if nothing else
    appeared there meanwhile, :func:`rename_noreplace`). A folder with entries, with
    ``replace``: it is renamed aside, ``staged`` takes its place and the old one is removed.

    Raises:
        RouteToolError: ``path`` holds something and not ``replace``, or the renames failed.
    """
    import shutil

    staged, path = Path(staged), Path(path)
    if path_kind(path) == "folder" and not replace:
        try:
            path.rmdir()  # (an empty folder; one with entries stays and is refused below)
        except OSError:
            pass
    old = None
    try:
        if replace and path_kind(path) == "folder":
            old = staged_folder(path)
            os.replace(path, old)  # (the new empty folder `old` is replaced by the old run folder)
        rename_noreplace(staged, path)
    except FileExistsError:
        if old is not None:
            os.replace(old, path)
        raise _already_written(path) from None
    except OSError as exc:
        if old is not None and path_kind(path) == "missing":
            os.replace(old, path)
        raise RouteToolError(f"cannot write ({exc.strerror or exc})", path=path,
                             fix="check free disk space and permissions") from None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


PATH_KINDS = ("missing", "dangling link", "file", "folder", "special")
"""What :func:`path_kind` finds at a path."""


def _path_error(exc: BaseException, shown: object) -> RouteToolError:
    """The one-line error for a path the system cannot examine (``exc`` from ``os.stat``,
    ``Path.resolve`` or ``os.path.samefile``)."""
    if isinstance(exc, ValueError):  # "embedded null byte" (a name from a file: an index's shard path)
        return RouteToolError("the path holds a NUL byte, which no file name can", path=shown,
                              fix="write the name without it")
    if isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP:  # Path.resolve: "Symlink loop"
        return RouteToolError("a symbolic link on this path points in a loop", path=shown,
                              fix="make the link point to a file or folder, or name another path")
    if getattr(exc, "errno", None) == errno.ENAMETOOLONG:
        return RouteToolError("the name is too long for the file system", path=shown, fix="choose a shorter name")
    return RouteToolError(f"cannot be examined ({getattr(exc, 'strerror', None) or exc})", path=shown,
                          fix="check the path and its folders' permissions")


def path_kind(path: str | os.PathLike, *, shown: object = None) -> str:
    """What ``path`` names, following symbolic links: one of :data:`PATH_KINDS`.

    The one place where routetool asks the system about a path it is given (an input, an
    output, an index's shard, a folder above an output): ``missing`` (also below a file,
    ``notes.txt/out.json``), ``dangling link`` (a link to nothing), ``file``, ``folder`` or
    ``special`` (a FIFO, device or socket, or a link to one).

    Args:
        path: the path. shown: how messages name it (default ``path``).

    Raises:
        RouteToolError: the path cannot be examined: a loop of symbolic links, a NUL byte in
            the name, a name too long, a folder on the way that cannot be searched; one line
            naming ``shown`` (:func:`_path_error`).
    """
    shown = path if shown is None else shown
    try:
        try:
            mode = os.stat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            try:
                os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                return "missing"
            return "dangling link"
    except (OSError, ValueError) as exc:
        raise _path_error(exc, shown) from None
    return "file" if stat.S_ISREG(mode) else "folder" if stat.S_ISDIR(mode) else "special"


def require_input(path: str | os.PathLike, *, what: str = "file", shown: object = None) -> str:
    """Refuse an input that is not there, before any work (and before torch is imported): one line,
    ``PATH: no such file (check the path)`` (``what``: ``file or folder`` where a folder is taken
    too). A link to nothing counts as missing. Returns :func:`path_kind`'s answer otherwise.

    Raises:
        RouteToolError: the path is missing, or cannot be examined (:func:`path_kind`).
    """
    shown = path if shown is None else shown
    kind = path_kind(path, shown=shown)
    if kind in ("missing", "dangling link"):
        raise RouteToolError(f"no such {what}", path=shown, fix="check the path")
    return kind


def resolved(path: str | os.PathLike, *, shown: object = None) -> Path:
    """``path`` made absolute with its links followed (:meth:`pathlib.Path.resolve`), also when
    it does not exist yet.

    Raises:
        RouteToolError: a loop of symbolic links, a NUL byte and the other cases of :func:`path_kind`.
    """
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise _path_error(exc, path if shown is None else shown) from None


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file or folder (by resolved path, or as hard links).

    Raises:
        RouteToolError: either path cannot be examined (:func:`path_kind`).
    """
    if resolved(a) == resolved(b):
        return True
    if path_kind(a) in ("missing", "dangling link") or path_kind(b) in ("missing", "dangling link"):
        return False
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError) as exc:
        raise _path_error(exc, a) from None


def refuse_special_file(path: str | os.PathLike, *, fix: str) -> None:
    """Refuse an input path that exists but is neither a regular file nor a folder (a FIFO, a
    device, a socket, or a link to one), before anything opens it: reading one could block
    forever, and its name says nothing about what it holds.

    A missing path or a folder is left to the reader, which names them.

    Raises:
        RouteToolError: naming the path and ``fix``; a path that cannot be examined (:func:`path_kind`).
    """
    if path_kind(path) == "special":
        raise RouteToolError("is not a regular file (a FIFO, device or socket); reading it could block", path=path,
                             fix=fix)


def missing_folders(path: str | os.PathLike) -> tuple[Path, list[Path]]:
    """``path``'s nearest ancestor (or ``path`` itself) that is there, a dangling link included,
    and the paths below it that are not, innermost first (``path`` first when it is missing).

    Raises:
        RouteToolError: a path on the way cannot be examined (:func:`path_kind`).
    """
    existing, missing = Path(path), []
    while path_kind(existing) == "missing" and existing != existing.parent:
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
            folder`` naming that path, or ``folder does not exist`` naming ``folder``; a path
            that cannot be examined (:func:`path_kind`).
    """
    folder = Path(folder) if str(folder) else Path(".")
    if path_kind(folder) == "folder":
        return
    blocker, _ = missing_folders(folder)
    kind = path_kind(blocker)
    if kind == "dangling link":
        raise RouteToolError("is a link to a missing path, not a folder", path=blocker,
                             fix="choose another output path, or make the link point to a folder")
    if kind in ("file", "special"):
        what = "a file" if kind == "file" else "a FIFO, device or socket"
        raise RouteToolError(f"is {what}, not a folder", path=blocker, fix="choose another output path")
    raise RouteToolError("folder does not exist", path=folder, fix="create it first")


def natural_key(p: Path) -> list:
    """A sort key for file names in natural order (``step2`` before ``step10``): the name's runs
    of digits compared as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]
