"""One self-contained HTML page of a report (``--html PATH``), to attach to an issue or a pull
request where a terminal screenshot would lose the tables and the figures.

The page is the report's terminal face with every table (``terminal(console, details=True)``),
taken from what it prints rather than from the drawn text: each rich table becomes an HTML table
(sortable by a click on a column header when it has more than :data:`SORTABLE_ROWS` rows), each
panel a section, each line of text a line with its colours. So the page and the terminal show
the same tables and the same verdict, decided once by the result. Above them, the verdict and the
exit code from the JSON document (``document()``); below, the figures the report draws for
``--plot`` (``plots(folder)`` or ``figure(path)``) as PNG data, and the run: the exact command,
the versions, the machine and the commit (:mod:`routetool.report.provenance`) with the JSON
document's own facts (its ``execution``, its ``router``).

Nothing is fetched: the figures are ``data:`` URLs, the style and the script (sorting, and a note
under a figure that does not decode) are inline, and a Content-Security-Policy forbids any other
load, so the page opens offline and from an attachment.
"""

from __future__ import annotations

import base64
import hashlib
import html
import importlib.util
import io
import json
import tempfile
from pathlib import Path

from rich.console import Group
from rich.panel import Panel
from rich.segment import Segment
from rich.style import Style
from rich.table import Table
from rich.text import Text

from routetool.errors import RouteToolError, install_extra, printable
from routetool.report.provenance import provenance
from routetool.report.tables import Console

SORTABLE_ROWS = 8
"""A table with more rows than this sorts by a click on a column header."""

_WIDTH = 120
"""The width the report is laid out for where it asks the console's width (bars)."""

_STYLE = """
:root { color-scheme: light dark; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 80em;
       margin: 1.2em auto; padding: 0 1em; }
h1 { font-size: 1.4em; margin: 0 0 .3em; }
h2 { font-size: 1.15em; margin: 1.6em 0 .5em; border-bottom: 1px solid #8886; }
nav a { margin-right: 1em; }
code, pre, .line, table { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace;
                          font-size: 13px; }
.line { white-space: pre-wrap; margin: .15em 0; }
.verdict { font-size: 1.25em; padding: .4em .8em; margin: .4em 0; border-left: 6px solid #888;
           background: #8881; }
.verdict.good { border-color: #2e7d32; } .verdict.bad { border-color: #c62828; }
.verdict.neutral { border-color: #b07800; }
.panel { border: 1px solid #8886; border-radius: 4px; padding: .4em .9em; margin: .7em 0; width: fit-content;
         max-width: 100%; box-sizing: border-box; }
.panel > h3 { font-size: 1em; margin: 0 0 .3em; }
.scroll { overflow-x: auto; margin: .7em 0; }
table { border-collapse: collapse; }
caption { text-align: left; font-weight: 600; padding: .2em 0; }
th, td { padding: .15em .7em; border-bottom: 1px solid #8884; vertical-align: top; white-space: pre-wrap; }
th { text-align: left; border-bottom: 2px solid #8888; }
.r { text-align: right; }
table.grid td { border: 0; padding: .05em 1em .05em 0; }
table.sortable th { cursor: pointer; user-select: none; }
th[aria-sort=ascending]::after { content: " \\25B2"; }
th[aria-sort=descending]::after { content: " \\25BC"; }
.caption { font-size: 13px; opacity: .8; }
.b { font-weight: 700; } .dim { opacity: .65; } .i { font-style: italic; }
.red { color: #c62828; } .green { color: #2e7d32; } .yellow { color: #b07800; }
.cyan { color: #00838f; } .blue { color: #1565c0; } .magenta { color: #ad1457; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; background: #fff; }
.note { color: #b07800; }
"""

_SCRIPT = """
function sortKey(row, i) {
  var t = row.cells[i] ? row.cells[i].textContent.trim() : "";
  if (t === "" || t === "-") return [2, 0];
  var m = t.replace(/,/g, "").match(/^[-+]?(\\d+\\.?\\d*|\\.\\d+)(e[-+]?\\d+)?/i);
  return m ? [0, parseFloat(m[0])] : [1, t.toLowerCase()];
}
document.querySelectorAll("table.sortable th").forEach(function (th) {
  th.tabIndex = 0;
  th.title = "sort by this column";
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0], i = th.cellIndex;
    var up = th.getAttribute("aria-sort") !== "ascending";
    table.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", up ? "ascending" : "descending");
    Array.from(body.rows).map(function (r) { return [sortKey(r, i), r]; }).sort(function (a, b) {
      if (a[0][0] !== b[0][0]) return a[0][0] - b[0][0];
      var d = a[0][1] < b[0][1] ? -1 : a[0][1] > b[0][1] ? 1 : 0;
      return up ? d : -d;
    }).forEach(function (p) { body.appendChild(p[1]); });
  });
  th.addEventListener("keydown", function (e) {
    if (e.key === "Enter" || e.key === " ") { e.preventDefault(); th.click(); }
  });
});
addEventListener("load", function () {
  document.querySelectorAll("img.figure").forEach(function (img) {
    var ok = img.complete && img.naturalWidth > 0;
    img.dataset.decoded = ok ? "yes" : "no";
    if (!ok) {
      var p = document.createElement("p");
      p.className = "note";
      p.textContent = "This figure could not be decoded: the file may have been cut short.";
      img.after(p);
    }
  });
});
"""


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


CONTENT_SECURITY_POLICY = (f"default-src 'none'; img-src data:; style-src '{_sha256(_STYLE)}'; "
                           f"script-src '{_sha256(_SCRIPT)}'; base-uri 'none'; form-action 'none'")
"""The page's policy: no load of any kind but ``data:`` images, its own style and its own script
(by their hashes: an inline style attribute or a script put into the page does not run)."""

_COLOURS = ("red", "green", "yellow", "cyan", "blue", "magenta")


def _classes(style: Style | None) -> str:
    """The page's classes for a rich style: bold, dim, italic and six colours (others are dropped)."""
    if style is None:
        return ""
    names = [name for name, on in (("b", style.bold), ("dim", style.dim), ("i", style.italic)) if on]
    colour = style.color.name.removeprefix("bright_") if style.color is not None else ""
    if colour in _COLOURS:
        names.append(colour)
    return " ".join(names)


class _Recorder(Console):
    """A console that keeps what a report prints (its tables, panels and lines), to be written as
    HTML instead of drawn; laid out for :data:`_WIDTH` columns where the report asks its width."""

    def __init__(self) -> None:
        super().__init__(file=io.StringIO(), width=_WIDTH, color_system=None, force_terminal=False)
        self.printed: list = []

    def print(self, *objects, **kwargs) -> None:  # noqa: A003 - rich's name
        self.printed.extend(objects)


class _Writer:
    """rich renderables as HTML, every piece of text escaped."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def text(self, value) -> Text:
        return self.console.render_str(value, highlight=False) if isinstance(value, str) else value

    def style(self, style: str | Style | None) -> Style:
        return self.console.get_style(style, default=Style.null()) if isinstance(style, str) else style or Style.null()

    def inline(self, value) -> str:
        """A str (rich markup, as the terminal reads it) or a Text as escaped HTML with its styles."""
        text = self.text(value)
        base = self.style(text.style)  # (a Text's own style is not in its segments)
        out = []
        for seg in Segment.simplify(text.render(self.console, end="")):
            classes = _classes(base + seg.style if seg.style else base)
            body = html.escape(seg.text)
            out.append(f'<span class="{classes}">{body}</span>' if classes else body)
        return "".join(out)

    def block(self, obj) -> str:
        """One printed renderable as HTML: a line of text, a table, a panel (a section), a group;
        anything else as the text the terminal would show."""
        if isinstance(obj, (str, Text)):
            return f'<div class="line">{self.inline(obj)}</div>'
        if isinstance(obj, Table):
            return self.table(obj)
        if isinstance(obj, Panel):
            title = f"<h3>{self.inline(obj.title)}</h3>" if obj.title else ""
            return f'<section class="panel">{title}{self.block(obj.renderable)}</section>'
        if isinstance(obj, Group):
            return "".join(self.block(r) for r in obj.renderables)
        drawn = Console(file=io.StringIO(), width=_WIDTH, record=True, color_system=None)
        drawn.print(obj)
        return f"<pre>{html.escape(drawn.export_text())}</pre>"

    def cell(self, value) -> str:
        return self.inline(value) if isinstance(value, (str, Text)) else self.block(value)

    def table(self, t: Table) -> str:
        columns = [(c, list(c.cells)) for c in t.columns]
        grid = not t.show_header
        kind = "grid" if grid else "sortable" if t.row_count > SORTABLE_ROWS else "plain"
        parts = [f'<div class="scroll"><table class="{kind}">']
        if t.title:
            parts.append(f"<caption>{self.inline(t.title)}</caption>")
        if not grid:
            heads = "".join(f'<th{_align(c)}>{self.cell(c.header)}</th>' for c, _ in columns)
            parts.append(f"<thead><tr>{heads}</tr></thead>")
        parts.append("<tbody>")
        for i, row in enumerate(t.rows):
            classes = _classes(self.style(row.style))
            cells = "".join(f"<td{_align(c)}>{self.cell(cells[i]) if i < len(cells) else ''}</td>"
                            for c, cells in columns)
            parts.append(f'<tr class="{classes}">{cells}</tr>' if classes else f"<tr>{cells}</tr>")
        parts.append("</tbody></table>")
        if t.caption:
            parts.append(f'<p class="caption">{self.inline(t.caption)}</p>')
        parts.append("</div>")
        return "".join(parts)


def _align(column) -> str:
    return ' class="r"' if column.justify == "right" else ""


def report_figures(report) -> tuple[list[tuple[str, bytes]], str | None]:
    """The PNG figures ``report`` draws for ``--plot`` (``plots(folder, force)``: a folder of them,
    captioned by their file names; ``figure(path)``: one), drawn into a temporary folder and read
    back, as ``(caption, png)`` pairs; and a note when there are none to show although the report draws some (matplotlib
    missing, a drawing that failed).

    Raises:
        RouteToolError: the temporary folder cannot be created.
    """
    plots, figure = getattr(report, "plots", None), getattr(report, "figure", None)
    if plots is None and figure is None:
        return [], None
    if importlib.util.find_spec("matplotlib") is None:
        return [], f"The figures need matplotlib, which is not installed: {install_extra('plot')}."
    try:
        with tempfile.TemporaryDirectory(prefix="routetool-html-") as folder:
            try:
                paths = plots(folder, force=True) if plots is not None else [figure(Path(folder) / "plot.png")]
            except RouteToolError as exc:
                return [], f"The figures could not be drawn: {exc}"
            return [("the --plot figure" if plots is None else Path(p).stem.replace("_", " "), Path(p).read_bytes())
                    for p in paths], None
    except OSError as exc:
        raise RouteToolError(f"cannot create a temporary folder for the figures ({exc.strerror or exc})",
                             fix="set TMPDIR to a writable folder") from None


def _facts(document: dict) -> list[tuple[str, str]]:
    """The JSON document's own facts of the run: its top-level numbers and strings, and the
    members of its objects of numbers and strings (``execution.device_name``, ``router.topk``)."""

    def scalar(v) -> bool:
        return v is None or isinstance(v, (bool, int, float, str))

    def shown(v) -> str:
        return printable(v) if isinstance(v, str) else json.dumps(v)

    out = []
    for key, value in document.items():
        if scalar(value):
            out.append((key, shown(value)))
        elif isinstance(value, dict) and value and all(scalar(v) for v in value.values()):
            out += [(f"{key}.{k}", shown(v)) for k, v in value.items()]
    return out


def _grid(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<div class="scroll"><table class="grid"><tbody>{body}</tbody></table></div>'


def _verdict(document: dict, exit_code: int) -> tuple[str, str]:
    """The banner's words and class: the document's verdict (``PASS``, ``DIFFERENT``) with the exit
    code, or the exit code alone where the document has no verdict (balance measures, bench times)."""
    verdict = document.get("verdict")
    words = f"{str(verdict).replace('_', ' ').upper()} · exit code {exit_code}" if verdict else f"exit code {exit_code}"
    kind = "bad" if exit_code else "good" if str(verdict).lower() in ("pass", "identical") else "neutral"
    return words, kind


def html_report(report, *, name: str, command: str | None = None) -> str:
    """The page of ``report`` (:class:`routetool.report.protocol.Report`) of ``routetool NAME``.

    Args:
        report: the report: its terminal face with every table, its document, its figures.
        name: the command's name (``replay``), for the title.
        command: the command line as run, shown as it is (None: not known).

    Returns:
        The HTML text (UTF-8), a few tens of KB plus the figures' PNG data.

    Raises:
        RouteToolError: the figures' temporary folder cannot be created.
    """
    recorder = _Recorder()
    report.terminal(recorder, details=True)
    writer = _Writer(recorder)
    document = report.document()
    exit_code = report.exit_code
    words, kind = _verdict(document, exit_code)
    headline = document.get("headline")
    figures, note = report_figures(report)
    facts = provenance(command)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f'<meta name="generator" content="routetool {html.escape(facts["routetool"])}">',
        f"<title>routetool {html.escape(name)}: {html.escape(words)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<header><h1>routetool {html.escape(name)}</h1>",
        f'<p class="verdict {kind}" id="verdict"><strong>{html.escape(words)}</strong></p>',
    ]
    if headline:
        out.append(f'<p class="line">{html.escape(printable(str(headline)))}</p>')
    out.append(f'<p><code>{html.escape(printable(facts["command"]))}</code></p>')
    out.append('<nav><a href="#report">Report</a><a href="#figures">Figures</a><a href="#run">Run</a></nav></header>')
    out.append('<main><section id="report"><h2>Report</h2>')
    out += [writer.block(obj) for obj in recorder.printed]
    out.append('</section><section id="figures"><h2>Figures</h2>')
    for caption, png in figures:
        data = base64.b64encode(png).decode("ascii")
        out.append(f'<figure><img class="figure" alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
                   f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    if note:
        out.append(f'<p class="note">{html.escape(printable(note))}</p>')
    elif not figures:
        out.append(f"<p>routetool {html.escape(name)} draws no figures.</p>")
    out.append('</section><section id="run"><h2>Run</h2>')
    out.append(_grid([(k, printable(v)) for k, v in facts.items()]))
    out.append("<h3>From the JSON document (--json)</h3>")
    out.append(_grid(_facts(document)))
    out.append(f"</section></main><script>{_SCRIPT}</script></body></html>\n")
    return "\n".join(out)
