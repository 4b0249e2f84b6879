"""The report protocol: what a command hands to the terminal and to its sinks.

A report wraps one result (a dataclass of the engine or an analysis, which carries its verdict)
and the choices of how to show it (a layer to chart). It has two faces: :meth:`Report.terminal`
prints the tables on a rich console, :meth:`Report.document` returns the JSON document.
Other documents are optional methods a sink asks for (:mod:`routetool.report.sinks`):
``junit() -> str`` (validate), ``csv() -> str`` (bench), ``placement() -> dict | None``
(balance's ``--eplb-out``), ``plots(folder, force) -> list[Path]`` (balance's ``--plot``).
A command never writes a document itself: it names its sinks, and the command base
(:mod:`routetool.cli.command`) renders the report and hands it to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from routetool.report.tables import Console


class Report(Protocol):
    """One command's report: its exit code, its terminal tables and its JSON document."""

    @property
    def exit_code(self) -> int:
        """The process's exit code: 0 (pass, nothing checked) or 1 (the check found problems)."""

    def terminal(self, console: Console, details: bool = False) -> None:
        """Print the report on ``console`` (a one-screen summary; ``details``: every table)."""

    def document(self) -> dict:
        """The JSON document (``--json``): plain dicts, lists, strings and numbers; non-finite
        floats are written as null by the sink."""
