"""Reporters: result dataclasses -> rich tables, terminal bars and JSON documents.

Nothing below this module knows about rich; nothing here computes results.
"""

from __future__ import annotations

import copy
import errno
import json
import math
import os
import re
from dataclasses import asdict, replace
from pathlib import Path

from rich import box
from rich.console import Console as RichConsole
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from typing import TYPE_CHECKING

from routetool.engine.verdict import Verdict
from routetool.errors import printable
from routetool.files import atomic_write

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    from routetool.compare import ComparisonSummary
    from routetool.load import LoadStats
    from routetool.replay import ReplayResult


class Console(RichConsole):
    """rich's console, except that a write to a closed pipe raises :class:`BrokenPipeError`
    (rich itself exits with code 1, which routetool keeps for "the check found a problem");
    the ``routetool`` group turns it into exit code 141."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more to write there
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


REPLAY_SCHEMA = "routetool.replay/1"
_BLOCKS = " ▁▂▃▄▅▆▇█"


# ---------------------------------------------------------------------------------------
# formatting helpers
def fmt_float(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.{digits - 1}e}"
    return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")


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
        lines.append(Text("bar height = assignments / busiest expert; · = idle expert", style="dim"))
    footer = Text(f"mean {mean:,.1f} assignments/expert, max {peak:,}, total {total:,} assignments", style="dim")
    return Panel(Group(*lines, footer), title=title, expand=False)


# ---------------------------------------------------------------------------------------
# replay
_NAMES = {
    "kernel_vs_reference": "kernel vs ref",
    "reference_vs_recorded": "recorded vs ref",
    "kernel_vs_recorded": "kernel vs recorded",
}


class _WholeWordTable(Table):
    """A rich Table that never cuts a word of a cell, so never a number (``1,044,480``): rich
    narrows the widest columns below their longest word when a table is wider than the
    terminal and ends the word with "…". Here a column narrows only down to its longest word
    (a header of several words wraps); a table whose longest words alone are wider than the
    terminal is shown as several tables of consecutive columns, each repeating the first
    (the row's name: layer, family, kernel) and titled as a continuation of the first."""

    def __rich_console__(self, console, options):
        if (not self.columns or any(c.width is not None for c in self.columns)  # widths already fitted
                or not all(hasattr(Table, m) for m in ("_measure_column", "_get_padding_width", "_extra_width"))):
            # (the measuring uses rich's own column measure; a rich without it folds long cells instead)
            yield from super().__rich_console__(console, options)
            return
        wide = options.update_width(1 << 20)
        pads = [self._get_padding_width(c._index) for c in self.columns]
        ranges = [self._measure_column(console, wide, c) for c in self.columns]
        need = [r.minimum - pad for r, pad in zip(ranges, pads)]  # content widths: the longest word
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
    t = _WholeWordTable(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                        collapse_padding=True)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return t


_SUMMARY_ROWS = ("rows", "exact", "reordered", "tie-eq (exact)", "mismatch", "invalid", "padded ok",
                 "max |Δw|", "max rel Δw", "Δw > tol", "verdict")


def _summary_column(s: ComparisonSummary) -> list:
    return [
        f"{s.rows:,}",
        _count(s.exact),
        _count(s.reordered),
        Text(f"{s.tie_equivalent:,} ({s.exact_ties:,})", style="yellow" if s.tie_equivalent else "dim"),
        _count(s.mismatch, bad=True),
        _count(s.invalid, bad=True),
        _count(s.padded),
        fmt_float(s.weight_max_abs_err),
        fmt_float(s.weight_max_rel_err),
        _count(s.weight_rows_over_tolerance, bad=True),
        Text("-", style="dim") if not s.rows else Text("pass", style="green") if s.ok else Text("FAIL", style="bold red"),
    ]


def router_line(r, router_parameters: str | None = None) -> Text:
    """A header's router line: E, topk and the router parameters of ``r`` (a
    :class:`~routetool.trace.RouterConfig`); with ``router_parameters`` (the metadata of an
    imported ids-only trace, where only E and topk are real) that text in place of the
    placeholder parameters."""
    if router_parameters is not None:
        return user_text(f"E={r.num_experts} topk={r.topk}; router parameters {router_parameters}")
    return Text(f"E={r.num_experts} topk={r.topk} {r.router_score_normalization} route_scale={r.route_scale:g} "
                f"multiplier={r.router_output_multiplier} eps={r.router_score_division_eps}")


def render_replay(result: ReplayResult, console: Console, histogram_layer: int | None = None,
                  details: bool = False) -> None:
    """Print the replay report, verdict first.

    By default one screen whatever the number of layers: the header, the verdict with the
    numbers behind it, the comparisons in one table (the reasons behind ``invalid`` named), the
    layers that failed, the first failing rows with both outputs and weights, the load in one
    line, latency of the most frequent step shapes, and a pointer to ``--details``. ``details``:
    every table (per layer, every step shape, the expert-load chart). ``histogram_layer``: the
    chart of that layer (either way).
    """
    r = result.router
    ex = result.execution
    header = Table.grid(padding=(0, 2))
    header.add_row("trace", user_text(result.trace))
    header.add_row("model", user_text(result.model or "-"))
    header.add_row("router", router_line(r, result.router_parameters))
    header.add_row("kernel", user_text(f"{result.kernel} on {ex.device_name}"))
    header.add_row("ties", f"tie-equivalent within {result.tie_ulps:g} float32 ulps")
    console.print(Panel(header, title="routetool replay", expand=False))
    _replay_verdict(result, console)
    if details:
        _replay_details(result, console, histogram_layer)
        return
    _replay_summary(result, console, histogram_layer)


_SHORT_NAMES = {"kernel_vs_reference": "kernel/ref", "reference_vs_recorded": "recorded/ref",
                "kernel_vs_recorded": "kernel/recorded"}
FAILING_ROWS_SHOWN = 3
"""Failing rows in replay's summary (``--details``: up to 10)."""
SHAPES_SHOWN = 5
"""Step shapes in replay's summary latency table (the most frequent; ``--details``: all)."""
LAYERS_SHOWN = 10
"""Failing layers named in replay's summary."""


def _reasons(s: ComparisonSummary) -> str:
    return ", ".join(f"{r} {n:,}" for r, n in s.invalid_reasons.items() if n)


def _replay_summary(result: ReplayResult, console: Console, histogram_layer: int | None) -> None:
    totals = result.totals()
    compared = [(n, s) for n, s in totals.items() if s.rows]
    if compared:
        t = table("Comparisons (rows of all replayed layers)",
                  ["", "rows", "exact", "reord", "tie-eq", "mism", "inval", "Δw>tol", "max|Δw|", "verdict"], left=("",))
        for name, s in compared:
            t.add_row(_SHORT_NAMES.get(name, name), f"{s.rows:,}", _count(s.exact), _count(s.reordered),
                      Text(f"{s.tie_equivalent:,}", style="yellow" if s.tie_equivalent else "dim"),
                      _count(s.mismatch, bad=True), _count(s.invalid, bad=True),
                      _count(s.weight_rows_over_tolerance, bad=True), fmt_float(s.weight_max_abs_err),
                      Text("pass", style="green") if s.ok else Text("FAIL", style="bold red"))
        console.print(t)
        for name, s in compared:
            if s.invalid:
                console.print(Text(f"invalid rows ({_NAMES.get(name, name)}) by reason: {_reasons(s)}", style="red"))
    bad_layers = [layer for layer in result.layers if not layer.ok]
    if bad_layers:
        parts = []
        for layer in bad_layers[:LAYERS_SHOWN]:
            s = layer.kernel_vs_reference
            what = [f"{v:,} {k}" for k, v in (("mismatch", s.mismatch), ("invalid", s.invalid),
                                                ("Δw>tol", s.weight_rows_over_tolerance)) if v]
            for name, c in layer.comparisons().items():
                if name != "kernel_vs_reference" and not c.ok:
                    what.append(f"{_NAMES.get(name, name)} fails")
            if layer.recorded_invalid_rows:
                what.append(f"{layer.recorded_invalid_rows:,} invalid recorded rows")
            parts.append(f"L{layer.layer} ({', '.join(what)})")
        more = f" and {len(bad_layers) - LAYERS_SHOWN} more" if len(bad_layers) > LAYERS_SHOWN else ""
        console.print(Text(f"failing layers ({len(bad_layers)} of {len(result.layers)}): " + "; ".join(parts) + more,
                           style="red"))
    _recorded_invalid_layers(result, console)
    _failing_rows(result, console, FAILING_ROWS_SHOWN)
    _recorded_invalid_rows(result, console, FAILING_ROWS_SHOWN)
    tl = result.total_load
    imb = [(layer.layer, layer.load.imbalance) for layer in result.layers if layer.load and layer.load.imbalance]
    worst = max(imb, key=lambda x: x[1]) if imb else None
    console.print(Text(f"load ({_load_source(result)}): all layers max/mean {fmt_float(tl.imbalance)}, CV {fmt_float(tl.cv)}, idle experts "
                       f"{len(tl.idle)}" + (f"; most imbalanced layer {worst[0]} (max/mean {fmt_float(worst[1])})"
                                           if worst and len(result.layers) > 1 else "")))
    padded = sum(layer.padded_rows for layer in result.layers)
    nonfinite = sum(layer.nonfinite_rows for layer in result.layers)
    ties = sum(layer.boundary_ties for layer in result.layers)
    facts = [f"{padded:,} padded rows", f"{nonfinite:,} with non-finite logits", f"{ties:,} exact ties at the k-th pick"]
    ids_only = [layer.layer for layer in result.layers if layer.ids_only]
    if ids_only:
        facts.append(f"{len(ids_only)} ids-only layer(s): load from the recorded ids, nothing compared")
    console.print(Text("inputs: " + ", ".join(facts), style="dim"))
    if result.latency:
        shapes = sorted(result.latency, key=lambda x: -x.steps)[:SHAPES_SHOWN]
        lat = table(f"Latency (µs, CUDA-graph replay): {len(shapes)} most frequent of {len(result.latency)} step shapes",
                    ["tokens", "steps", "kernel p50", "p90", "reference p50", "speedup"])
        for x in sorted(shapes, key=lambda x: x.num_tokens):
            lat.add_row(f"{x.num_tokens:,}", f"{x.steps:,}", f"{x.kernel.p50_us:.2f}", f"{x.kernel.p90_us:.2f}",
                        f"{x.reference.p50_us:.2f}", f"{x.speedup:.1f}x")
        console.print(lat)
    else:
        console.print(Text(f"latency: {result.latency_note}", style="dim"))
    if histogram_layer is not None:
        layer = next(x for x in result.layers if x.layer == histogram_layer)
        console.print(histogram_renderable(
            layer.expert_counts,
            f"Expert load, layer {layer.layer} ({'recorded' if layer.ids_only else 'kernel'} ids)"))
    console.print(Text("--details: per-layer tables, every step shape's latency, the expert-load chart, more "
                       "failing rows; --json for all numbers", style="dim"))


def _values(values: list | None, fmt=str) -> str:
    """A row's ids or weights, compactly: ``3 17 42`` (``-1 ×8`` when all are equal, ``-`` for none)."""
    if values is None:
        return "-"
    if len(values) > 1 and all(v == values[0] for v in values):
        return f"{fmt(values[0])} ×{len(values)}"
    return " ".join(fmt(v) for v in values)


def _weights(values: list[float] | None) -> str:
    return _values(values, lambda w: fmt_float(w, 3))


def _failing_rows(result: ReplayResult, console: Console, limit: int) -> None:
    """The first failing rows, each on two lines: where, class and reasons; expected against got,
    ids and weights."""
    failures = [(name, f) for name, s in result.totals().items() for f in s.failures]
    if not failures:
        return
    console.print(Text(f"First failing rows ({min(limit, len(failures))} shown):", style="bold"))
    for name, f in failures[:limit]:
        console.print(user_text(f"  {_NAMES.get(name, name)}: layer {f.layer} step {f.step} row {f.row}: {f.row_class}"
                                + (f" ({', '.join(f.reasons)})" if f.reasons else ""), style="red"))
        console.print(Text(f"    expected ids {_values(f.expected_ids)}; w {_weights(f.expected_weights)}"))
        console.print(Text(f"    got      ids {_values(f.test_ids)}; w {_weights(f.test_weights)}"))


def _recorded_invalid_rows(result: ReplayResult, console: Console, limit: int) -> None:
    rows = [r for layer in result.layers for r in layer.recorded_invalid_first]
    if not rows:
        return
    total = sum(layer.recorded_invalid_rows for layer in result.layers)
    console.print(Text(f"First invalid recorded rows ({min(limit, len(rows))} of {total:,}; ids-only layers, checked "
                       "without logits):", style="bold"))
    for r in rows[:limit]:
        console.print(Text(f"  layer {r.layer} step {r.step} row {r.row} ({', '.join(r.reasons)}): ids "
                           f"{_values(r.topk_ids)}; w {_weights(r.topk_weights)}", style="red"))


def _recorded_invalid_layers(result: ReplayResult, console: Console) -> None:
    for layer in [x for x in result.layers if x.recorded_invalid_rows][:LAYERS_SHOWN]:
        why = ", ".join(f"{r}: {n:,}" for r, n in layer.recorded_invalid.items() if n)
        console.print(Text(f"• layer {layer.layer}: {layer.recorded_invalid_rows:,} rows of the recorded outputs are "
                           f"invalid ({why}); its load leaves them out", style="bold red"))


def _load_source(result: ReplayResult) -> str:
    ids_only = {layer.layer for layer in result.layers if layer.ids_only}
    return ("recorded ids" if len(ids_only) == len(result.layers) else
            "kernel ids; recorded ids on ids-only layers" if ids_only else "kernel ids")


def _replay_verdict(result: ReplayResult, console: Console) -> None:
    """The verdict line, with the numbers behind it (decided by ``result.verdict``)."""
    k = result.totals().get("kernel_vs_reference")
    # Nothing compared: every replayed layer is ids-only, or holds logits for no rows at all.
    why = ("hold no logits" if all(layer.ids_only for layer in result.layers) else
           "hold no rows" if not any(layer.ids_only for layer in result.layers) else
           "hold no logits or no rows")
    numbers = ""
    if k is not None and k.rows:
        numbers = (f" ({k.rows:,} rows: {k.exact:,} exact, {k.reordered:,} reordered, {k.tie_equivalent:,} "
                   f"tie-equivalent, {k.padded:,} padded ok; {k.mismatch:,} mismatch, {k.invalid:,} invalid"
                   + (f" [{_reasons(k)}]" if k.invalid else "") + f", {k.weight_rows_over_tolerance:,} weights out "
                   "of tolerance)")
    if result.verdict is Verdict.FAIL and result.compared_rows == 0:
        console.print(Text(f"FAIL: the replayed layers {why}, and some recorded outputs are invalid; exit code 1",
                           style="bold red"))
    elif result.verdict is Verdict.NOTHING_CHECKED:
        console.print(Text(f"NOTHING CHECKED: the replayed layers {why}", style="bold yellow"))
    elif result.verdict is Verdict.PASS:
        console.print(Text("PASS: no real mismatch, no invalid output, weights within tolerance" + numbers,
                           style="bold green"))
    else:
        console.print(Text("FAIL: the kernel (or the recorded output) disagrees with the reference; exit code 1"
                           + numbers, style="bold red"))




def _replay_details(result: ReplayResult, console: Console, histogram_layer: int | None) -> None:
    """Every table: the summary by comparison, per layer, latency per shape, the expert-load chart and the
    failing rows."""
    totals = result.totals()
    summary = table("Summary: rows of all replayed layers", ["", *(_NAMES.get(n, n) for n in totals)], left=("",))
    columns = [_summary_column(s) for s in totals.values()]
    for i, label in enumerate(_SUMMARY_ROWS):
        summary.add_row(label, *(col[i] for col in columns))
    console.print(summary)
    for name, s in totals.items():
        if s.invalid:
            console.print(Text(f"invalid rows ({_NAMES.get(name, name)}) by reason: {_reasons(s)}", style="red"))

    per_layer = table("Per layer: kernel vs reference",
                       ["layer", "tokens", "steps", "padded ok", "nonfinite", "exact", "reord", "tie-eq",
                        "mism", "inval"])
    for layer in result.layers:
        s = layer.kernel_vs_reference
        if layer.ids_only:  # nothing compared: no logits
            per_layer.add_row(str(layer.layer), f"{layer.num_tokens:,}", str(layer.num_steps), *["-"] * 7)
            continue
        pad_ok = layer.padded_rows_ok == layer.padded_rows
        per_layer.add_row(
            str(layer.layer), f"{layer.num_tokens:,}", str(layer.num_steps),
            Text(f"{layer.padded_rows_ok:,}/{layer.padded_rows:,}", style="" if pad_ok else "bold red"),
            _count(layer.nonfinite_rows), _count(s.exact), _count(s.reordered), _count(s.tie_equivalent),
            _count(s.mismatch, bad=True), _count(s.invalid, bad=True),
        )
    console.print(per_layer)

    load_table = table("Per layer: weights, k-th boundary, expert load (padded rows excluded)",
                        ["layer", "max|Δw|", "min margin", "ties@k", "max/mean", "CV", "idle", "hottest e:tokens"],
                        left=("hottest e:tokens",))
    for layer in result.layers:
        load = layer.load
        hot = ", ".join(f"{e}:{c}" for e, c in load.hottest[:3]) if load else "-"
        load_table.add_row(
            str(layer.layer), fmt_float(layer.kernel_vs_reference.weight_max_abs_err),
            fmt_float(layer.min_margin), _count(layer.boundary_ties),
            fmt_float(load.imbalance) if load else "-", fmt_float(load.cv) if load else "-",
            str(len(load.idle)) if load else "-", hot,
        )
    console.print(load_table)

    findings = []
    ids_only = [layer.layer for layer in result.layers if layer.ids_only]
    if ids_only:
        findings.append(f"layer(s) {', '.join(map(str, ids_only))} hold no logits (an ids-only trace): the kernel/"
                        "reference comparison, k-th margins and latency are skipped there; their load comes from the "
                        "recorded ids (`routetool balance` analyses such traces in depth)")
    _recorded_invalid_layers(result, console)
    nonfinite = sum(layer.nonfinite_rows for layer in result.layers)
    if nonfinite:
        findings.append(f"{nonfinite:,} rows have non-finite logits (NaN/inf); the reference routes them by the "
                        "documented safe rule (docs/semantics.md)")
    recorded = [layer for layer in result.layers if layer.reference_vs_recorded is not None]
    if recorded:
        findings.append(f"{len(recorded)} layer(s) carry recorded production outputs; compared above")
        if result.weights_semantics == "unnormalized":
            findings.append("recorded weights are unnormalized top-k scores: compared with the reference's raw "
                            "scores; kernel vs recorded compares ids only")
    for text in findings:
        console.print(Text("• " + text, style="yellow"))

    if result.latency:
        lat = table("Latency per step shape (µs, CUDA-graph replay)",
                     ["tokens", "steps", "kernel p10", "p50", "p90", "reference p50", "speedup"])
        for s in result.latency:
            lat.add_row(f"{s.num_tokens:,}", str(s.steps), f"{s.kernel.p10_us:.2f}", f"{s.kernel.p50_us:.2f}",
                        f"{s.kernel.p90_us:.2f}", f"{s.reference.p50_us:.2f}", f"{s.speedup:.1f}x")
        console.print(lat)
        console.print(Text(result.latency_note, style="dim"))
    else:
        console.print(Text(f"Latency: {result.latency_note}", style="dim"))

    source = _load_source(result)
    if histogram_layer is None:
        console.print(histogram_renderable(result.total_counts, f"Expert load, all replayed layers ({source})"))
        tl = result.total_load
        console.print(Text(f"all layers: max/mean {fmt_float(tl.imbalance)}, CV {fmt_float(tl.cv)}, "
                           f"idle experts {len(tl.idle)}", style="dim"))
    else:
        layer = next(x for x in result.layers if x.layer == histogram_layer)
        console.print(histogram_renderable(
            layer.expert_counts,
            f"Expert load, layer {layer.layer} ({'recorded' if layer.ids_only else 'kernel'} ids)"))
        if layer.load:
            idle = ", ".join(map(str, layer.load.idle[:20])) + (" ..." if len(layer.load.idle) > 20 else "")
            console.print(Text(f"layer {layer.layer}: max/mean {fmt_float(layer.load.imbalance)}, CV "
                               f"{fmt_float(layer.load.cv)}, idle experts: {idle or 'none'}", style="dim"))

    _failing_rows(result, console, 10)
    _recorded_invalid_rows(result, console, 10)
def _summary_json(s: ComparisonSummary) -> dict:
    d = asdict(s)
    d["ok"] = s.ok
    return d


def load_json(load: LoadStats | None, unit: str = "tokens") -> dict | None:
    """Load statistics as JSON; ``unit`` names what the counts count (``tokens``, ``assignments``)."""
    if load is None:
        return None
    return {
        "num_experts": load.num_experts,
        "assignments": load.assignments,
        f"max_load_{unit}": load.max_load,
        f"mean_load_{unit}": load.mean_load,
        "imbalance_max_over_mean": load.imbalance,
        "cv": load.cv,
        "normalized_entropy": load.normalized_entropy,
        "gini": load.gini,
        "hottest": [{"expert": e, unit: c} for e, c in load.hottest],
        "idle_experts": load.idle,
    }


def replay_json(result: ReplayResult) -> dict:
    """The replay result as the documented JSON document (docs/json-schema.md)."""
    import torch
    import triton

    r = result.router
    return {
        "schema": REPLAY_SCHEMA,
        "trace": result.trace,
        "model": result.model,
        "provenance": result.provenance,
        "router": asdict(r),
        "kernel": result.kernel,
        "execution": {
            "device": str(result.execution.device),
            "device_name": result.execution.device_name,
            "interpreted": result.execution.interpreted,
            "torch_version": torch.__version__,
            "triton_version": triton.__version__,
        },
        "tie_tolerance_ulps": result.tie_ulps,
        "weights_semantics": result.weights_semantics,
        "verdict": result.verdict.value,
        "exit_code": result.verdict.exit_code,
        "totals": {name: _summary_json(s) for name, s in result.totals().items()},
        "layers": [
            {
                "layer": layer.layer,
                "ids_only": layer.ids_only,
                "recorded_invalid": layer.recorded_invalid,
                "recorded_invalid_rows": layer.recorded_invalid_rows,
                "recorded_invalid_first_rows": [asdict(r) for r in layer.recorded_invalid_first],
                "num_tokens": layer.num_tokens,
                "num_steps": layer.num_steps,
                "padded_rows": layer.padded_rows,
                "padded_rows_ok": layer.padded_rows_ok,
                "nonfinite_rows": layer.nonfinite_rows,
                "nonfinite_padded_rows": layer.nonfinite_padded_rows,
                "min_boundary_margin": layer.min_margin,
                "boundary_ties": layer.boundary_ties,
                "comparisons": {name: _summary_json(s) for name, s in layer.comparisons().items()},
                "load": load_json(layer.load),
                "expert_counts_tokens": layer.expert_counts,
            }
            for layer in result.layers
        ],
        "load_all_layers": {**(load_json(result.total_load) or {}), "expert_counts_tokens": result.total_counts},
        "latency": {
            "measured": result.latency is not None,
            "note": result.latency_note,
            "shapes": [
                {
                    "num_tokens": s.num_tokens,
                    "steps": s.steps,
                    "timed_layer": s.layer,
                    "timed_step": s.step,
                    "kernel_latency_us": {"p10": s.kernel.p10_us, "p50": s.kernel.p50_us, "p90": s.kernel.p90_us},
                    "reference_latency_us": {"p10": s.reference.p10_us, "p50": s.reference.p50_us,
                                             "p90": s.reference.p90_us},
                    "speedup_p50": s.speedup,
                }
                for s in (result.latency or [])
            ],
        },
    }


def _clean(value):
    """Replace non-finite floats by None (JSON has no NaN/inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(document: dict, path: str, console_out) -> None:
    """Write ``document`` as JSON to ``path`` atomically, or to ``console_out`` when path is ``-``.

    Raises:
        RouteToolError: the folder is not writable or the disk is full.
    """
    write_text(json.dumps(_clean(document), indent=2, allow_nan=False) + "\n", path, console_out)


# ---------------------------------------------------------------------------------------
# validate
VALIDATE_SCHEMA = "routetool.validate/1"


def render_validate(result, console: Console, show_failures: int = 15) -> None:
    """Print validate's verdicts grouped by family, then the failing cases."""
    ex = result.execution
    console.print(Panel(user_text(f"kernel {result.kernel} on {ex.device_name}; suite {result.suite or '-'}; "
                                  f"ties within {result.tie_ulps:g} float32 ulps"),
                        title="routetool validate", expand=False))
    tbl = table("Verdicts by family", ["family", "cases", "pass", "pass (ties)", "tie rows", "rejected",
                                          "skipped", "fail", "failure classes"], left=("family", "failure classes"))
    families = result.families()
    tbl.columns[0].no_wrap = True  # family names whole, even at 80 columns
    tbl.columns[0].min_width = max((len(printable(f)) for f in families), default=6)
    for family, counts in families.items():
        classes = sorted({c for case in result.cases if case.family == family for c in case.failure_classes})
        total = sum(counts[v] for v in ("pass", "pass_tie", "rejected", "fail", "skipped"))
        tbl.add_row(user_text(family), str(total), _count(counts["pass"]), _count(counts["pass_tie"]),
                      _count(counts["tie_rows"]), _count(counts["rejected"]), _count(counts["skipped"]),
                      _count(counts["fail"], bad=True), Text(", ".join(classes), style="red" if classes else ""))
    console.print(tbl)
    rejected = [c for c in result.cases if c.verdict == "rejected"]
    if rejected:
        first = rejected[0]
        console.print(user_text(f"{len(rejected)} documented rejection(s), e.g. {first.name}: {first.message}",
                                style="dim"))
    failed = [c for c in result.cases if c.verdict == "fail"]
    if failed:
        ft = table(f"Failing cases ({len(failed)}; first {min(len(failed), show_failures)})",
                    ["case", "classes", "first offending row: expected ids -> got ids"], left=("case", "classes",
                    "first offending row: expected ids -> got ids"))
        for c in failed[:show_failures]:
            row = c.rows[0] if c.rows else None
            detail = (f"row {row.row}: {row.expected_ids} -> {row.got_ids}" if row else c.message)
            ft.add_row(user_text(c.name), ", ".join(c.failure_classes), user_text(detail))
        console.print(ft)
    n = len(result.cases)
    if result.verdict is Verdict.NOTHING_CHECKED:
        what = "skipped" if all(c.verdict == "skipped" for c in result.cases) else "skipped or rejected"
        console.print(Text(f"NOTHING CHECKED: all {n} cases were {what} (see above)", style="bold yellow"))
    elif result.verdict is Verdict.PASS:
        console.print(Text(f"PASS: {n} cases, nothing failed", style="bold green"))
    else:
        console.print(Text(f"FAIL: {len(failed)} of {n} cases failed; exit code {result.exit_code}", style="bold red"))


def validate_json(result) -> dict:
    """The validate result as a JSON document (docs/validate.md)."""
    import torch
    import triton

    return {
        "schema": VALIDATE_SCHEMA,
        "kernel": result.kernel,
        "suite": result.suite,
        "execution": {"device": str(result.execution.device), "device_name": result.execution.device_name,
                      "interpreted": result.execution.interpreted, "torch_version": torch.__version__,
                      "triton_version": triton.__version__},
        "tie_tolerance_ulps": result.tie_ulps,
        "verdict": result.verdict.value,
        "exit_code": result.exit_code,
        "families": result.families(),
        "cases": [
            {
                "family": c.family, "name": c.name, "description": c.description, "verdict": c.verdict,
                "tie_rows": c.tie_rows, "failure_classes": c.failure_classes, "message": c.message,
                "duration_s": c.duration_s, "rows": [asdict(r) for r in c.rows],
            }
            for c in result.cases
        ],
    }


_XML_ILLEGAL = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""Characters XML 1.0 cannot hold, not even as character references (its ``Char`` production)."""


def xml_safe(text: str) -> str:
    """``text`` with every character XML 1.0 cannot hold (control characters other than tab,
    newline and carriage return; lone surrogates; U+FFFE, U+FFFF) written as its Python escape
    (``\\x00``, ``\\x1b``, ``\\udc80``), so that any parser reads the document."""
    return _XML_ILLEGAL.sub(lambda m: repr(m.group())[1:-1], text)


def validate_junit(result) -> str:
    """The validate result as JUnit XML (one testsuite per family, one testcase per case).

    Characters XML 1.0 cannot hold (in a kernel's message, a trace's file name) are written
    as their Python escapes (:func:`xml_safe`): the document always parses.
    """
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name=f"routetool validate {result.kernel}")
    by_family: dict[str, list] = {}
    for c in result.cases:
        by_family.setdefault(c.family, []).append(c)
    for family, cases in by_family.items():
        suite = ET.SubElement(root, "testsuite", name=family, tests=str(len(cases)),
                              failures=str(sum(c.verdict == "fail" for c in cases)),
                              skipped=str(sum(c.verdict == "skipped" for c in cases)),
                              time=f"{sum(c.duration_s for c in cases):.3f}")
        for c in cases:
            tc = ET.SubElement(suite, "testcase", classname=family, name=c.name, time=f"{c.duration_s:.3f}")
            if c.verdict == "fail":
                failure = ET.SubElement(tc, "failure", message=c.message[:500], type=",".join(c.failure_classes))
                failure.text = "\n".join(f"row {r.row} [{r.failure_class}]: expected {r.expected_ids} got {r.got_ids}"
                                         for r in c.rows) or c.message
            elif c.verdict == "skipped":
                ET.SubElement(tc, "skipped", message=c.message)
            elif c.message:
                ET.SubElement(tc, "system-out").text = c.message
    ET.indent(root)
    # ElementTree writes such characters as they are; they never occur in its markup, only in
    # text and attribute values, so replacing them in the serialised document is safe
    return xml_safe(ET.tostring(root, encoding="unicode", xml_declaration=True)) + "\n"


def write_text(text: str, path: str, console_out) -> None:
    """Write ``text`` to ``path`` atomically, or to ``console_out`` when path is ``-``.

    Raises:
        RouteToolError: the folder is not writable or the disk is full.
    """
    if path == "-":
        console_out.write(text)
        console_out.flush()
        return
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


# ---------------------------------------------------------------------------------------
# bench
BENCH_SCHEMA = "routetool.bench/1"
BENCH_FIELDS = ("gpu_name", "driver_version", "torch_version", "triton_version", "kernel", "pdl", "num_tokens",
                "num_experts", "topk", "dtype", "cuda_graph", "status", "latency_us_p10", "latency_us_p50",
                "latency_us_p90", "bytes_moved", "bandwidth_gbps", "bandwidth_fraction_of_copy", "speedup_vs_baseline",
                "host_us_p10", "host_us_p50", "host_us_p90", "empty_launch_host_us_p50", "host_over_empty_launch")


def bench_records(result) -> list[dict]:
    """One flat record per (point, kernel): the long format of the CSV and JSON outputs. ``host_us_*``: the
    host cost per eager call; ``empty_launch_host_us_p50``: an empty Triton launch's, the floor, timed in turn
    with it; ``host_over_empty_launch``: their ratio (p50s)."""
    out = []
    for r in result.rows:
        out.append({
            "gpu_name": result.gpu_name, "driver_version": result.driver_version,
            "torch_version": result.torch_version, "triton_version": result.triton_version,
            "kernel": r.kernel, "pdl": r.pdl, "num_tokens": r.num_tokens, "num_experts": r.num_experts,
            "topk": r.topk, "dtype": r.dtype, "cuda_graph": r.cuda_graph, "status": r.status,
            "latency_us_p10": r.latency.p10_us if r.latency else None,
            "latency_us_p50": r.latency.p50_us if r.latency else None,
            "latency_us_p90": r.latency.p90_us if r.latency else None,
            "bytes_moved": r.bytes_moved, "bandwidth_gbps": r.bandwidth_gbps,
            "bandwidth_fraction_of_copy": r.bandwidth_fraction, "speedup_vs_baseline": r.speedup,
            "host_us_p10": r.host.p10_us if r.host else None,
            "host_us_p50": r.host.p50_us if r.host else None,
            "host_us_p90": r.host.p90_us if r.host else None,
            "empty_launch_host_us_p50": r.empty_launch.p50_us if r.empty_launch else None,
            "host_over_empty_launch": r.host.p50_us / r.empty_launch.p50_us if r.host and r.empty_launch else None,
        })
    return out


def bench_json(result) -> dict:
    return {"schema": BENCH_SCHEMA, "gpu_name": result.gpu_name, "driver_version": result.driver_version,
            "torch_version": result.torch_version, "triton_version": result.triton_version,
            "copy_bandwidth_gbps": result.copy_bandwidth_gbps, "baseline": result.baseline,
            "rows": bench_records(result)}


def bench_csv(result) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(BENCH_FIELDS))
    writer.writeheader()
    for rec in bench_records(result):
        writer.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return buf.getvalue()


def render_bench(result, console: Console) -> None:
    """Print the sweep as a table: GPU latency (p50 with p10/p90), bandwidth, speedup, and the host
    cost per eager call (p50) with its ratio to the empty Triton launch timed in turn with it."""
    floors = [r.empty_launch.p50_us for r in result.rows if r.empty_launch]
    console.print(Panel(f"{result.gpu_name}, driver {result.driver_version}, torch {result.torch_version}, "
                        f"triton {result.triton_version}; copy bandwidth {result.copy_bandwidth_gbps:,.0f} GB/s "
                        "(read + write)" + (f"; an empty Triton launch took {min(floors):.1f}-{max(floors):.1f} µs of "
                                            "host time per call, timed in turn with each row" if floors else ""),
                        title="routetool bench", expand=False))
    mode = "CUDA graph" if any(r.cuda_graph for r in result.rows) else "no graph"
    t = table(user_text(f"GPU latency (µs, {mode}) and bandwidth; speedup vs {result.baseline or '-'}; host µs per "
                        "eager call (x the empty launch)"),
              ["kernel", "tokens", "E", "k", "dtype", "p50", "p10-p90", "GB/s", "of copy", "speedup", "host",
               "x launch", "status"],
              left=("kernel", "dtype", "status"))
    for r in result.rows:
        label = r.kernel if r.pdl is None else f"{r.kernel} pdl {'on' if r.pdl else 'off'}"
        lat = r.latency
        t.add_row(user_text(label), f"{r.num_tokens:,}", str(r.num_experts), str(r.topk), r.dtype,
                  f"{lat.p50_us:.2f}" if lat else "-", f"{lat.p10_us:.2f}-{lat.p90_us:.2f}" if lat else "-",
                  f"{r.bandwidth_gbps:,.0f}" if r.bandwidth_gbps else "-",
                  f"{r.bandwidth_fraction:.0%}" if r.bandwidth_fraction else "-",
                  f"{r.speedup:.2f}x" if r.speedup else "-",
                  f"{r.host.p50_us:.1f}" if r.host else "-",
                  f"{r.host.p50_us / r.empty_launch.p50_us:.2f}x" if r.host and r.empty_launch else "-",
                  user_text(r.status, style="green" if r.status == "ok" else "bold red"))
    console.print(t)
