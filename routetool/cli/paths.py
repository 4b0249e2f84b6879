"""click parameter types for file and folder names that refuse an empty name.

``pathlib.Path("")`` is ``Path(".")``, so an empty argument (``routetool balance ''``, an unset
shell variable, ``--json ""``) used to name the current folder: a command then read the
folder and reported what it did not find there, or refused to write a document onto it.
These types refuse the empty name itself, as a usage error (exit 2)::

    @click.argument("trace", type=PATH)
    @click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH")
"""

from __future__ import annotations

from pathlib import Path

import click

EMPTY = "an empty name is no path (name a file or folder)"


class _NonEmpty:
    """Mixin: refuse the empty string, then convert as the click type does."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value == "":
            self.fail(EMPTY, param, ctx)
        return super().convert(value, param, ctx)


class NonEmptyPath(_NonEmpty, click.Path):
    """click's ``Path`` (as :class:`pathlib.Path`) without the empty name."""

    def __init__(self, **kwargs):
        super().__init__(path_type=Path, **kwargs)


class NonEmptyText(_NonEmpty, click.types.StringParamType):
    """click's ``STRING`` without the empty string: for names that may also be ``-`` (stdout)."""


PATH = NonEmptyPath()
PATH_TEXT = NonEmptyText()
