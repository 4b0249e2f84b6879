"""Shared pieces of every report: the console, number and text formatting, tables that never cut a
word, terminal bars, and a row's ids and weights written compactly."""

from __future__ import annotations

import copy
import errno
import math
import os
from dataclasses import replace
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console as RichConsole
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from routetool.errors import printable

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    pass


class Console(RichConsole):
    """rich's console, except that a write to a closed pipe raises :class:`BrokenPipeError`
    (rich itself exits with code 1, which routetool keeps for "the check found a problem");
    the ``routetool`` group turns it into exit code 141."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more to write there
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


_BLOCKS = " ▁▂▃▄▅▆▇█"


# ---------------------------------------------------------------------------------------
# formatting helpers
def fmt_float(value: float | None, digits: int = 3) -> str:
    """Every report's one form of a ratio or other measured number: ``digits`` decimals from 1
    up (``1.600``, ``3.184``), ``digits`` significant digits below 1 (``0.390``, ``0.0120``),
    trailing zeros kept so that numbers side by side line up; scientific below 1e-3 and from
    1e4 (``1.19e-07``); ``-`` for None, ``0`` for zero."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    small = f"{value:#.{digits}g}"
    return small if abs(value) < 1 and abs(float(small)) < 1 else f"{value:.{digits}f}"


def user_text(text: object, style: str = "") -> Text:
    """User-controlled text (a trace's file name, a kernel spec, metadata, a kernel's message) for
    a table, a header or a line: as plain text (brackets are not rich markup), with unprintable
    characters (a newline, an ANSI escape) written as their Python escapes (:func:`printable`),
    so that it stays on its line and names the file as it is; too long for its column, it folds
    onto the next lines rather than losing its end."""
    return Text(printable(str(text)), style=style, overflow="fold")


def markup_safe(text: str) -> str:
    """:func:`user_text` for a string that rich reads as markup (a progress bar's description)."""
    from rich.markup import escape

    return escape(printable(text))


def _count(value: int, bad: bool = False) -> Text:
    style = "bold red" if bad and value else ("dim" if not value else "")
    return Text(f"{value:,}", style=style)


# ---------------------------------------------------------------------------------------
# load histogram as terminal bars
def histogram_renderable(counts: list[int], title: str, width: int = 64) -> Panel:
    """Assignments per expert (a token counts once for each expert it picks) as terminal bars.

    Up to 64 experts: one horizontal bar per expert. More: one block character per
    expert (``width`` experts a line), height proportional to the load.
    """
    total = sum(counts)
    E = len(counts)
    peak = max(counts) if counts else 0
    mean = total / E if E else 0.0
    lines: list[Text] = []
    if E <= 64:
        bar_width = 40
        for e, c in enumerate(counts):
            n = round(bar_width * c / peak) if peak else 0
            style = "red" if peak and c == peak else ("dim" if c == 0 else "cyan")
            line = Text(f"{e:>4} ")
            line.append("█" * n, style=style)
            line.append(f" {c:,}")
            lines.append(line)
    else:
        for lo in range(0, E, width):
            chunk = counts[lo:lo + width]
            line = Text(f"{lo:>4}-{lo + len(chunk) - 1:<4} ")
            for c in chunk:
                level = 0 if not peak else max(1 if c else 0, round(8 * c / peak))
                style = "red" if peak and c == peak else ("dim red" if c == 0 else "cyan")
                line.append(_BLOCKS[level] if c else "·", style=style)
            lines.append(line)
        lines.append(Text("bar height = assignments / busiest expert" + ("; · = idle expert" if 0 in counts else ""),
                          style="dim"))  # (the legend names the marks the chart shows)
    footer = Text(f"mean {mean:,.1f} assignments/expert, max {peak:,}, total {total:,} assignments", style="dim")
    return Panel(Group(*lines, footer), title=title, expand=False)


class _WholeWordTable(Table):
    """A rich Table that never cuts a word of a cell, so never a number (``1,044,480``): rich
    narrows the widest columns below their longest word when a table is wider than the
    terminal and ends the word with "…". Here a column narrows only down to its longest word
    (a header of several words wraps), the first column (the row's name) not at all; a table whose longest words alone are wider than the
    terminal is shown as several tables of consecutive columns, each repeating the first
    (the row's name: layer, family, kernel) and titled as a continuation of the first."""

    def __rich_console__(self, console, options):
        # the title and the caption take the terminal's width before they wrap to the table's:
        # a title's last word never stands on its own line under a narrow table
        longest = max((len(t.plain if isinstance(t, Text) else str(t)) for t in (self.title, self.caption) if t),
                      default=0)
        self.min_width = max(self.min_width or 0, min(longest, options.max_width))
        if (not self.columns or any(c.width is not None for c in self.columns)  # widths already fitted
                or not all(hasattr(Table, m) for m in ("_measure_column", "_get_padding_width", "_extra_width"))):
            # (the measuring uses rich's own column measure; a rich without it folds long cells instead)
            yield from super().__rich_console__(console, options)
            return
        wide = options.update_width(1 << 20)
        pads = [self._get_padding_width(c._index) for c in self.columns]
        ranges = [self._measure_column(console, wide, c) for c in self.columns]
        need = [r.minimum - pad for r, pad in zip(ranges, pads)]  # content widths: the longest word
        need[0] = ranges[0].maximum - pads[0]  # the row's name (``kernel/recorded FAIL``) is never wrapped
        room = options.max_width - self._extra_width
        if sum(r.maximum for r in ranges) <= room:
            yield from super().__rich_console__(console, options)
        elif sum(need) + sum(pads) <= room:
            widths = [r.maximum - pad for r, pad in zip(ranges, pads)]
            for _ in range(sum(widths) + sum(pads) - room):  # narrow the column with the most room to spare
                i = max(range(len(widths)), key=lambda j: widths[j] - need[j])
                widths[i] -= 1
            yield from self._with_widths(console, options, widths)
        else:
            groups, group = [], [0]
            for i in range(1, len(self.columns)):  # 1 for the padding and 1 for the rule of each column
                if len(group) > 1 and sum(need[j] + 2 for j in (*group, i)) > room:
                    groups.append(group)
                    group = [0]
                group.append(i)
            groups.append(group)
            for n, group in enumerate(groups):
                part = copy.copy(self)
                part.columns = [replace(self.columns[j], _index=k) for k, j in enumerate(group)]
                # a continuation keeps the row labels (the first column) and says what it continues
                plain = self.title.plain if isinstance(self.title, Text) else str(self.title or "")
                part.title = self.title if n == 0 or not plain else f"{plain} (continued)"
                yield from part._with_widths(console, options, [need[j] for j in group])

    def _with_widths(self, console, options, widths):
        """Render with the given content widths (padding not included)."""
        columns = self.columns
        self.columns = [replace(c, width=max(1, w)) for c, w in zip(columns, widths)]
        try:
            yield from console.render(self, options)
        finally:
            self.columns = columns


def table(title: str | Text, columns: list[str], left: tuple[str, ...] = ()) -> Table:
    """A report table: ``columns`` right-aligned (numbers) except those in ``left``; a cell's
    words, numbers included, are never cut (:class:`_WholeWordTable`)."""
    t = _WholeWordTable(title=title, title_justify="left", caption_justify="left", box=box.SIMPLE_HEAD,
                        padding=(0, 1), pad_edge=False, collapse_padding=True)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return t


def router_line(r, router_parameters: str | None = None) -> Text:
    """A header's router line: ``r.describe()`` (a :class:`routetool_kernels.spec.RouterSpec`); with
    ``router_parameters`` (the metadata of an imported ids-only trace, where only E and topk are
    real) that text in place of the placeholder parameters."""
    if router_parameters is not None:
        return user_text(f"E={r.num_experts} topk={r.topk}; router parameters {router_parameters}")
    return Text(r.describe())


def _values(values: list | None, fmt=str) -> str:
    """A row's ids or weights, compactly: ``3 17 42`` (``-1 ×8`` when all are equal, ``-`` for none)."""
    if values is None:
        return "-"
    if len(values) > 1 and all(v == values[0] for v in values):
        return f"{fmt(values[0])} ×{len(values)}"
    return " ".join(fmt(v) for v in values)


def _weights(values: list[float] | None) -> str:
    return _values(values, lambda w: fmt_float(w, 3))




def layer_list(layers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts, start, prev = [], None, None
    for x in [*layers, None]:
        if start is not None and (x is None or x != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if x is not None and start is None:
            start = x
        prev = x
    return ", ".join(parts)
