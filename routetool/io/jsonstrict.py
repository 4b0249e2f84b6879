"""The one strict JSON reader: every JSON text routetool reads goes through :func:`loads`.

Dumps, counts files, sharded-trace indexes, EPLB placements, model configs, ``--set`` values
and the header of every safetensors trace (:func:`routetool.io.trace.read_header`) are parsed
here, with three rules :func:`json.loads` does not keep:

* a key given twice in one object is refused (:class:`DuplicateKey`): :func:`json.loads`
  keeps the last value silently, other readers (and the safetensors spec) differ, so a file
  that relies on either is ambiguous;
* nesting deeper than :data:`MAX_DEPTH` arrays and objects is refused (:class:`TooDeep`),
  checked before parsing: Python's parser recurses and would fail with a ``RecursionError``
  (``[[[[...`` a hundred thousand deep);
* a number written with more than :data:`MAX_NUMBER_CHARS` characters is refused
  (:class:`NumberTooLong`) before it is converted: Python refuses integers of more than
  4,300 digits with a ``ValueError``, and converting long ones costs time quadratic in their
  length. No number routetool reads needs more than 20 digits.

Everything else is standard JSON as :func:`json.loads` reads it (``NaN`` and ``Infinity``
included, so that the readers can name a non-finite weight where it stands). Every refusal is
a :class:`JSONProblem`, which :meth:`JSONProblem.error` turns into the one-line
:class:`~routetool.errors.RouteToolError`; :func:`load_file` reads a whole file that way::

    doc = load_file(path, fix="pass an index written by routetool's recorder")
    obj = loads(line)          # raises JSONProblem
"""

from __future__ import annotations

import json
import os
import re

from routetool.errors import RouteToolError
from routetool.io.paths import path_kind

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (routetool's own files nest at most 5 deep)."""
MAX_NUMBER_CHARS = 100
"""Longest number accepted, in characters (sign, digits, point and exponent)."""


class JSONProblem(ValueError):
    """Why the strict reader refuses a text.

    Attributes:
        reason: what is wrong, one line (``nested deeper than 64 levels``).
        line: the 1-based line of the text where it is, or None where not known.
        fix: a fix that belongs to the problem itself (``write each key once ...``), or
            None: the caller's fix applies.
    """

    def __init__(self, reason: str, *, line: int | None = None, fix: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.line = line
        self.fix = fix

    def error(self, path: object, *, fix: str, where: str | None = None, tensor: str | None = None) -> RouteToolError:
        """The one-line error naming ``path`` (and ``tensor``), where in the text (``where``,
        e.g. ``line 17`` of a JSON-lines file; default: the problem's own line) and the fix
        (the problem's own, else ``fix``)."""
        where = where if where is not None else (f"line {self.line}" if self.line is not None else None)
        return RouteToolError(f"{where}: {self.reason}" if where else self.reason, path=path, tensor=tensor,
                              fix=self.fix or fix)


class DuplicateKey(JSONProblem):
    """A JSON object holds ``key`` twice."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} appears twice in one object (JSON readers differ on which value counts)",
                         fix="write each key once in each object")
        self.key = key


class TooDeep(JSONProblem):
    """Arrays and objects nested deeper than :data:`MAX_DEPTH`."""


class NumberTooLong(JSONProblem):
    """A number of more than :data:`MAX_NUMBER_CHARS` characters."""


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict.

    Raises:
        DuplicateKey: a key appears twice in the object.
    """
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def _number(convert):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise NumberTooLong(f"a number of {len(text):,} characters ({text[:12]}...): at most "
                                f"{MAX_NUMBER_CHARS} are read", fix="write the number with at most 20 digits")
        return convert(text)
    return parse


_parse_int, _parse_float = _number(int), _number(float)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}\n]")


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` (brackets inside strings do not count).

    Time linear in the text; texts with few brackets (a JSON line) cost two counts."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth, line = 0, 1
    for m in _BRACKET.finditer(_STRING.sub('""', text) if '"' in text else text):
        c = m.group()
        if c == "\n":
            line += 1
        elif c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise TooDeep(f"arrays and objects nested deeper than {MAX_DEPTH} levels", line=line)
        else:
            depth -= 1


def loads(text: str) -> object:
    """Parse one JSON text strictly (see the module docstring).

    Args:
        text: the JSON text (decoded; a BOM is the caller's to strip).

    Returns:
        The value, objects as dicts.

    Raises:
        JSONProblem: not JSON (``not JSON (Expecting value)``, with its line), a key twice in one
            object (:class:`DuplicateKey`), nesting deeper than :data:`MAX_DEPTH`
            (:class:`TooDeep`), a number longer than :data:`MAX_NUMBER_CHARS` (:class:`NumberTooLong`).
    """
    _check_depth(text)
    try:
        return json.loads(text, object_pairs_hook=unique_keys, parse_int=_parse_int, parse_float=_parse_float)
    except json.JSONDecodeError as exc:
        raise JSONProblem(f"not JSON ({exc.msg})", line=exc.lineno) from None
    except RecursionError:  # (the depth check comes first; this is its backstop)
        raise TooDeep(f"arrays and objects nested deeper than {MAX_DEPTH} levels") from None


def decode(data: bytes, path: object, *, fix: str) -> str:
    """``data`` (a whole file) as UTF-8 text, a BOM dropped.

    Raises:
        RouteToolError: not UTF-8, naming the line and the byte.
    """
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RouteToolError(f"line {line}: not UTF-8 text (byte {exc.start + 1} of the file is {data[exc.start]:#04x})",
                             path=path, fix=fix) from None


def load_file(path: str | os.PathLike, *, fix: str, shown: object = None, tensor: str | None = None) -> object:
    """Read a whole JSON file with :func:`loads`.

    Args:
        path: the file (checked with :func:`routetool.io.paths.path_kind` first).
        fix: what to do about a file that is no JSON routetool reads.
        shown: the name the messages give the file (default ``path``).
        tensor: what the messages name after the file (``index``), or None.

    Raises:
        RouteToolError: a missing file, a folder, a FIFO, device or socket (or a path that
            cannot be examined: :func:`~routetool.io.paths.path_kind`), a file that cannot be
            read, text that is not UTF-8, or a :class:`JSONProblem`; one line naming the file.
    """
    shown = path if shown is None else shown
    kind = path_kind(path, shown=shown)
    if kind != "file":
        what = {"missing": "no such file", "dangling link": "no such file", "folder": "is a directory, not a JSON file"
                }.get(kind, "is not a regular file (a FIFO, device or socket); reading it could block")
        raise RouteToolError(what, path=shown, fix="check the path" if what == "no such file" else fix)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise RouteToolError(f"cannot read file ({exc.strerror or exc})", path=shown, fix="check permissions") from None
    try:
        return loads(decode(data, shown, fix=fix))
    except JSONProblem as exc:
        raise exc.error(shown, fix=fix, tensor=tensor) from None
