"""Sinks: the documents written beside the terminal report, each from a :class:`Report`.

A sink knows its option (``--json``), its path (``'-'`` = stdout, None = not asked for) and
which face of the report it writes: :class:`JsonSink` (``document()``, or another dict such as
balance's placement), :class:`JUnitSink` (``junit()``), :class:`CsvSink` (``csv()``) and
:class:`PlotSink` (``plots()``, a folder of PNG figures), :class:`FigureSink`
(``figure()``, one PNG file) and :class:`HtmlSink` (one self-contained page of all of them,
:mod:`routetool.report.html`). :class:`Sinks` holds a command's
sinks and the stdout rule, computed here once: at most one sink writes stdout, and when one
does, the tables go to stderr and a kernel's ``print()`` too (the document on stdout holds the
document only)::

    sinks = Sinks(JsonSink(json_path), JUnitSink(junit_path))
    sinks.check()                          # RouteToolError: --json - and --junit - both want stdout
    console = Console(stderr=sinks.to_stdout)
    report.terminal(console); sinks.write(report)

A new format is a sink here and, where the report needs a new face, one method on the report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from routetool.errors import RouteToolError
from routetool.report.formats import write_json, write_text
from routetool.report.tables import Console, user_text

STDOUT = "-"
"""The path that names stdout."""


class Sink:
    """A document written to ``path`` (``'-'``: stdout; None: not asked for), named ``flag`` in
    messages. ``announce``: after writing a file, say ``wrote PATH`` on stderr."""

    flag = ""

    def __init__(self, path: str | None, *, flag: str | None = None, announce: bool = False) -> None:
        self.path = path
        if flag is not None:
            self.flag = flag
        self.announce = announce

    @property
    def to_stdout(self) -> bool:
        """Whether this sink writes stdout."""
        return self.path == STDOUT

    @property
    def output_path(self) -> str | None:
        """The file this sink writes, for the output-path checks (None for stdout or a folder)."""
        return None if self.to_stdout else self.path

    @property
    def output_folder(self) -> str | None:
        """The folder this sink writes, for the output-path checks (None for a file or stdout)."""
        return None

    def write(self, report) -> list[str]:
        """Write the document of ``report``; returns the files written (for ``wrote PATH``).

        Raises:
            RouteToolError: the folder is not writable or the disk is full.
        """
        raise NotImplementedError


class JsonSink(Sink):
    """``--json PATH``: ``document(report)`` as JSON (default: ``report.document()``); a
    document of None (e.g. no EPLB placement) writes nothing."""

    flag = "--json"

    def __init__(self, path: str | None, *, flag: str | None = None, announce: bool = False,
                 document: Callable[[object], dict | None] | None = None) -> None:
        super().__init__(path, flag=flag, announce=announce)
        self.document = document or (lambda report: report.document())

    def write(self, report) -> list[str]:
        doc = self.document(report)
        if doc is None:
            return []
        write_json(doc, self.path, sys.stdout)
        return [self.path]


class JUnitSink(Sink):
    """``--junit PATH``: ``report.junit()``, a JUnit XML document."""

    flag = "--junit"

    def write(self, report) -> list[str]:
        write_text(report.junit(), self.path, sys.stdout)
        return [self.path]


class CsvSink(Sink):
    """``--csv PATH``: ``report.csv()``, a long-format CSV document."""

    flag = "--csv"

    def write(self, report) -> list[str]:
        write_text(report.csv(), self.path, sys.stdout)
        return [self.path]


class PlotSink(Sink):
    """``--plot DIR``: ``report.plots(DIR, force)``, PNG figures in a folder (never stdout: a
    folder named ``-`` is a folder); ``force`` replaces the figures there."""

    flag = "--plot"

    def __init__(self, path: str | None, *, force: bool = False, announce: bool = True) -> None:
        super().__init__(path, announce=announce)
        self.force = force

    @property
    def to_stdout(self) -> bool:
        return False

    @property
    def output_path(self) -> None:
        return None  # a folder: checked by the report's own plot checks

    @property
    def output_folder(self) -> str | None:
        return self.path

    def write(self, report) -> list[str]:
        return [str(p) for p in report.plots(self.path, force=self.force)]


class FigureSink(Sink):
    """``--plot FILE.png``: ``report.figure(FILE)``, one PNG figure in a file (never stdout)."""

    flag = "--plot"

    @property
    def to_stdout(self) -> bool:
        return False

    @property
    def output_path(self) -> str | None:
        return self.path

    def write(self, report) -> list[str]:
        return [str(report.figure(self.path))]


class HtmlSink(Sink):
    """``--html PATH``: the report as one self-contained HTML page (:func:`routetool.report.html.html_report`):
    the verdict, every table, the figures, and ``command`` (the command line as run) with the
    versions, the machine and the commit; ``name``: the command's name, for the title."""

    flag = "--html"

    def __init__(self, path: str | None, *, name: str, command: str | None = None, announce: bool = True) -> None:
        super().__init__(path, announce=announce)
        self.name = name
        self.command = command

    def write(self, report) -> list[str]:
        from routetool.report.html import html_report

        write_text(html_report(report, name=self.name, command=self.command), self.path, sys.stdout)
        return [self.path]


class Sinks:
    """A command's sinks, in the order they write; those not asked for (path None) left out."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = [s for s in sinks if s.path is not None]

    def adding(self, sink: Sink) -> Sinks:
        """These sinks and ``sink`` after them (the command base's ``--html``)."""
        return Sinks(*self.sinks, sink)

    def check(self) -> None:
        """The stdout rule: at most one sink writes stdout.

        Raises:
            RouteToolError: two sinks name ``-`` (``--json - and --junit - both want stdout``).
        """
        on_stdout = [s for s in self.sinks if s.to_stdout]
        if len(on_stdout) > 1:
            raise RouteToolError(f"{on_stdout[0].flag} - and {on_stdout[1].flag} - both want stdout",
                                 fix="write one of them to a file")

    @property
    def to_stdout(self) -> bool:
        """Whether a document goes to stdout: the tables, and a kernel's ``print()``, then go to stderr."""
        return any(s.to_stdout for s in self.sinks)

    @property
    def paths(self) -> list[str]:
        """The files the sinks write (for the output-path checks: never one file twice, never an input)."""
        return [s.output_path for s in self.sinks if s.output_path is not None]

    @property
    def folders(self) -> list[str]:
        """The folders the sinks write (never named twice, never an input folder or inside one)."""
        return [s.output_folder for s in self.sinks if s.output_folder is not None]

    def write(self, report) -> None:
        """Write every sink's document of ``report``, in order; an announcing sink says ``wrote
        PATH`` on stderr for each file it wrote.

        Raises:
            RouteToolError: a folder is not writable or the disk is full.
        """
        status = None
        for sink in self.sinks:
            for path in sink.write(report):
                if sink.announce and path != STDOUT:
                    status = status or Console(stderr=True)
                    status.print(user_text(f"wrote {path}"))
