"""The replay report: verdict first, the comparisons, failing layers and rows (summary), or every
table (``--details``); and its JSON document (docs/replay-json.md)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from routetool.engine.verdict import Verdict
from routetool.report.formats import idle_layer_expert_pairs, load_json
from routetool.report.partial import partial_json, render_partial
from routetool.report.tables import (
    Console,
    _count,
    _values,
    _weights,
    fmt_float,
    histogram_renderable,
    router_line,
    table,
    user_text,
)

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    from routetool.analysis.replay import ReplayResult
    from routetool.engine.compare import ComparisonSummary


REPLAY_SCHEMA = "routetool.replay/1"


# ---------------------------------------------------------------------------------------
# replay
_NAMES = {
    "kernel_vs_reference": "kernel/ref",
    "reference_vs_recorded": "recorded/ref",
    "kernel_vs_recorded": "kernel/recorded",
}
"""The one name of each comparison in the terminal (its JSON key is the long form)."""


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
    render_partial(result.partial, console)  # (before anything: a verdict on part of a recording)
    r = result.router
    ex = result.execution
    header = Table.grid(padding=(0, 2))
    header.add_row("trace", user_text(result.trace))
    header.add_row("model", user_text(result.model or "-"))
    header.add_row("router", router_line(r, result.router_parameters))
    header.add_row("kernel", user_text(f"{result.kernel} on {ex.device_name}") if _routed(result)
                   else Text("none ran: the replayed layers hold no logits", style="dim"))
    if _routed(result):
        header.add_row("ties", f"tie-equivalent within {result.tie_ulps:g} float32 ulps")
    if result.ranks is not None:
        header.add_row("ranks", f"{len(result.ranks)} ({_rank_span(result)}), replayed rank by rank and summed")
    if result.world_size > 1:
        header.add_row("processes", f"{result.world_size} (torchrun), the "
                                    + ("ranks' layers" if result.ranks is not None else "layers") + " shared among them")
    console.print(Panel(header, title="routetool replay", expand=False))
    _replay_verdict(result, console)
    _ranks_line(result, console)
    for note in result.notes:
        console.print(user_text(f"note: {note}", style="yellow"))
    if details:
        _replay_details(result, console, histogram_layer)
        return
    _replay_summary(result, console, histogram_layer)


RANKS_SHOWN = 5
"""Failing ranks named in replay's summary (``--details``: a table of every rank)."""


def _rank_span(result: ReplayResult) -> str:
    labels = [f"rank-{r.rank}" for r in result.ranks]
    return ", ".join(labels) if len(labels) <= 4 else f"{labels[0]} ... {labels[-1]}"


def _ranks_line(result: ReplayResult, console: Console) -> None:
    """One line on the ranks of a run folder: all pass, or the failing ones with their counts."""
    if result.ranks is None:
        return
    bad = [r for r in result.ranks if not r.ok]
    if not bad:
        by: dict[str, int] = {}
        for r in result.ranks:
            name = r.verdict.value.replace("_", " ")
            by[name] = by.get(name, 0) + 1
        text = f"all {len(result.ranks)} {next(iter(by))}" if len(by) == 1 else ", ".join(f"{n} {v}" for v, n in by.items())
        console.print(Text(f"ranks: {text}", style="green" if set(by) == {"pass"} else "yellow"))
        return
    parts = []
    for r in bad[:RANKS_SHOWN]:
        s = r.kernel_vs_reference
        what = [f"{v:,} {k}" for k, v in (("mismatch", s.mismatch), ("invalid", s.invalid),
                                            ("Δw>tol", s.weight_rows_over_tolerance)) if v]
        parts.append(f"rank-{r.rank} ({', '.join(what) or 'recorded outputs fail'})")
    more = f" and {len(bad) - RANKS_SHOWN} more" if len(bad) > RANKS_SHOWN else ""
    console.print(Text(f"failing ranks ({len(bad)} of {len(result.ranks)}): " + "; ".join(parts) + more, style="red"))


def _where(f) -> str:
    """Where a failing row is: ``[rank-R ]layer L step S row N``."""
    return (f"rank-{f.rank} " if f.rank is not None else "") + f"layer {f.layer} step {f.step} row {f.row}"




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
        # (the comparison's verdict in its label, ✗ for a failing one: a column of its own, or the
        # word FAIL, would not fit 80 columns; the verdict line names them in words)
        t = table("Comparisons (rows of all replayed layers" + ("; ✗ fails)" if any(not s.ok for _, s in compared)
                                                                else ")"),
                  ["", "rows", "exact", "reord", "tie-eq", "mism", "inval", "Δw>tol", "max|Δw|"], left=("",))
        for name, s in compared:
            label = _NAMES.get(name, name)
            t.add_row(Text(label, style="green") if s.ok else Text(f"{label} ✗", style="bold red"),
                      f"{s.rows:,}", _count(s.exact), _count(s.reordered),
                      Text(f"{s.tie_equivalent:,}", style="yellow" if s.tie_equivalent else "dim"),
                      _count(s.mismatch, bad=True), _count(s.invalid, bad=True),
                      _count(s.weight_rows_over_tolerance, bad=True), fmt_float(s.weight_max_abs_err))
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
                                                ("weights out of tolerance", s.weight_rows_over_tolerance)) if v]
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
    console.print(Text(f"load ({_load_source(result)}): all layers max/mean {fmt_float(tl.imbalance)}, CV {fmt_float(tl.cv)}"
                       f"; {_idle(result)}" + (f"; most imbalanced layer {worst[0]} (max/mean {fmt_float(worst[1])})"
                                               if worst and len(result.layers) > 1 else "")))
    inputs = _inputs(result)
    facts = [f"{inputs['padded_rows']:,} padded rows"]
    if _routed(result):  # (rows of logits only: an ids-only layer has neither)
        facts += [f"{inputs['nonfinite_rows']:,} non-finite rows",
                  f"{inputs['boundary_ties']:,} boundary ties (rows tied exactly at the k-th pick)"]
    if inputs["ids_only_layers"]:
        facts.append(f"{inputs['ids_only_layers']} ids-only layer(s): load from the recorded ids, nothing compared")
    console.print(Text("inputs: " + ", ".join(facts), style="dim"))
    if not _routed(result):
        pass  # (no kernel ran: no latency to speak of)
    elif result.latency:
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
                       "failing rows; --json for all numbers" if _routed(result) else
                       "--details: per-layer tables and the expert-load chart; --json for all numbers", style="dim"))


def _routed(result: ReplayResult) -> bool:
    """Whether a kernel ran: some replayed layer holds logits (an ids-only layer is only counted)."""
    return any(not layer.ids_only for layer in result.layers)


def _inputs(result: ReplayResult) -> dict:
    """What the replayed rows held, summed over the layers: the terminal's ``inputs:`` line and
    the JSON's ``inputs`` (``nonfinite_rows`` and ``boundary_ties`` count rows of logits; None
    where no layer holds any)."""
    routed = _routed(result)
    return {
        "padded_rows": sum(layer.padded_rows for layer in result.layers),
        "nonfinite_rows": sum(layer.nonfinite_rows for layer in result.layers) if routed else None,
        "boundary_ties": sum(layer.boundary_ties for layer in result.layers) if routed else None,
        "ids_only_layers": sum(layer.ids_only for layer in result.layers),
    }


def _outputs_grid(rows: list[tuple[str, list[int], list[float] | None]]) -> Table:
    """Both outputs of a failing row, one line each, ids and weights in columns of their own (a
    long line wraps within its column, so expected and got stay aligned)."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(min_width=12, justify="right")
    grid.add_column()
    grid.add_column()
    for label, ids, weights in rows:
        grid.add_row(label, f"ids {_values(ids)};", f"w {_weights(weights)}")
    return grid


def _idle(result: ReplayResult) -> str:
    """Idle experts as balance counts them: per layer, summed (JSON ``load_all_layers.idle_layer_expert_pairs``)."""
    return f"idle layer-expert pairs {idle_layer_expert_pairs(x.load for x in result.layers):,}"


_REASON_WORDS = {"weight_outside_tolerance": "weights out of tolerance"}
"""A failing row's reason in the terminal's words, where they differ from its JSON name."""


def _failing_rows(result: ReplayResult, console: Console, limit: int) -> None:
    """The first failing rows, each on two lines: where, class and reasons; expected against got,
    ids and weights."""
    failures = [(name, f) for name, s in result.totals().items() for f in s.failures]
    if not failures:
        return
    console.print(Text(f"First failing rows ({min(limit, len(failures))} shown):", style="bold"))
    for name, f in failures[:limit]:
        console.print(user_text(f"  {_NAMES.get(name, name)}: {_where(f)}: {f.row_class}"
                                + (f" ({', '.join(_REASON_WORDS.get(r, r) for r in f.reasons)})" if f.reasons else ""),
                                style="red"))
        console.print(_outputs_grid([("expected", f.expected_ids, f.expected_weights),
                                     ("got", f.test_ids, f.test_weights)]))


def _recorded_invalid_rows(result: ReplayResult, console: Console, limit: int) -> None:
    rows = [r for layer in result.layers for r in layer.recorded_invalid_first]
    if not rows:
        return
    total = sum(layer.recorded_invalid_rows for layer in result.layers)
    console.print(Text(f"First invalid recorded rows ({min(limit, len(rows))} of {total:,}; ids-only layers, checked "
                       "without logits):", style="bold"))
    for r in rows[:limit]:
        console.print(Text(f"  {_where(r)} ({', '.join(r.reasons)}): ids "
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
    compared = {name: s for name, s in result.totals().items() if s.rows}
    failing = [name for name, s in compared.items() if not s.ok]
    # the comparisons the verdict rests on in full, the others with what weakens their pass
    full = failing or (["kernel_vs_reference"] if k is not None and k.rows else [])
    parts = [_numbers(name, compared[name]) for name in full]
    parts += [_weaker(name, s) for name, s in compared.items() if name not in full]
    numbers = f" ({'; '.join(parts)})" if parts else ""
    if result.verdict is Verdict.FAIL and result.compared_rows == 0:
        console.print(Text(f"FAIL: the replayed layers {why}, and some recorded outputs are invalid; exit code 1",
                           style="bold red"))
    elif result.verdict is Verdict.NOTHING_CHECKED:
        console.print(Text(f"NOTHING CHECKED: the replayed layers {why}", style="bold yellow"))
    elif result.verdict is Verdict.PASS:
        console.print(Text("PASS: no real mismatch, no invalid output, weights within tolerance" + numbers,
                           style="bold green"))
    else:
        what = (" and ".join(_NAMES.get(name, name) for name in failing)
                + (" fail" if len(failing) > 1 else " fails")) if failing else "some recorded outputs are invalid"
        console.print(Text(f"FAIL: {what}; exit code 1" + numbers, style="bold red"))
    pattern = result.recorded_pattern
    if pattern:
        console.print(Text(f"• {pattern}", style="yellow"))


def _numbers(name: str, s: ComparisonSummary) -> str:
    """A comparison's counts for the verdict line, under its one name (``kernel/ref``...)."""
    return (f"{_NAMES.get(name, name)}: {s.rows:,} rows: {s.exact:,} exact, {s.reordered:,} reordered, "
            f"{s.tie_equivalent:,} tie-equivalent, {s.padded:,} padded ok; {s.mismatch:,} mismatch, {s.invalid:,} invalid"
            + (f" [{_reasons(s)}]" if s.invalid else "")
            + ("; ids only, weights not compared" if s.weight_rtol is None
               else f", {s.weight_rows_over_tolerance:,} weights out of tolerance"))


def _weaker(name: str, s: ComparisonSummary) -> str:
    """A passing comparison besides the verdict's own: what makes its pass weaker than exact
    equality (ids only, reordered rows, rows that differ inside a tie), counted."""
    weak = (["ids only (weights not compared)"] if s.weight_rtol is None else []) \
        + [f"{n:,} {what}" for n, what in ((s.reordered, "reordered"), (s.tie_equivalent, "tie-equivalent")) if n]
    return f"{_NAMES.get(name, name)} passes" + (f": {', '.join(weak)}" if weak else "")


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

    if result.ranks is not None:
        per_rank = table("Per rank: kernel vs reference", ["rank", "role", "layers", "tokens", "steps", "exact", "mism",
                                                           "inval", "Δw>tol", "verdict"], left=("rank", "role"))
        for r in result.ranks:
            k = r.kernel_vs_reference
            per_rank.add_row(f"rank-{r.rank}", r.role or "-", f"{len(r.layers):,}", f"{r.num_tokens:,}",
                             f"{r.num_steps:,}", _count(k.exact), _count(k.mismatch, bad=True),
                             _count(k.invalid, bad=True), _count(k.weight_rows_over_tolerance, bad=True),
                             Text(r.verdict.value.replace("_", " "), style="green" if r.ok else "bold red"))
        console.print(per_rank)

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
        console.print(Text(f"all layers: max/mean {fmt_float(tl.imbalance)}, CV {fmt_float(tl.cv)}; {_idle(result)}",
                           style="dim"))
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


def _row_json(row) -> dict:
    """A failing or invalid row as JSON; ``rank`` only for a run folder's rows."""
    d = asdict(row)
    if d.get("rank", 0) is None:
        del d["rank"]
    return d


def _summary_json(s: ComparisonSummary) -> dict:
    d = asdict(s)
    d["failures"] = [_row_json(f) for f in s.failures]
    d["ok"] = s.ok
    return d


def replay_json(result: ReplayResult) -> dict:
    """The replay result as the documented JSON document (docs/json-schema.md)."""
    import torch
    import triton

    r = result.router
    return {
        "schema": REPLAY_SCHEMA,
        "trace": result.trace,
        **partial_json(result.partial),
        "model": result.model,
        "provenance": result.provenance,
        "router": r.document(),
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
        "inputs": _inputs(result),
        "recorded_pattern": result.recorded_pattern,
        "world_size": result.world_size,
        "notes": result.notes,
        "ranks": None if result.ranks is None else [
            {"rank": r.rank, "trace": r.trace, "role": r.role, "layers": r.layers, "num_tokens": r.num_tokens,
             "num_steps": r.num_steps, "ok": r.ok, "verdict": r.verdict.value,
             "kernel_vs_reference": _summary_json(r.kernel_vs_reference)}
            for r in result.ranks
        ],
        "layers": [
            {
                "layer": layer.layer,
                "ids_only": layer.ids_only,
                "recorded_invalid": layer.recorded_invalid,
                "recorded_invalid_rows": layer.recorded_invalid_rows,
                "recorded_invalid_first_rows": [_row_json(r) for r in layer.recorded_invalid_first],
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
        "load_all_layers": {**(load_json(result.total_load) or {}), "expert_counts_tokens": result.total_counts,
                            "idle_layer_expert_pairs": idle_layer_expert_pairs(x.load for x in result.layers)},
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




class ReplayReport:
    """replay's report (:class:`routetool.report.protocol.Report`): ``histogram_layer`` charted,
    exit code from the result's verdict."""

    def __init__(self, result: ReplayResult, histogram_layer: int | None = None) -> None:
        self.result = result
        self.histogram_layer = histogram_layer

    @property
    def exit_code(self) -> int:
        return self.result.verdict.exit_code

    def terminal(self, console: Console, details: bool = False) -> None:
        render_replay(self.result, console, self.histogram_layer, details=details)

    def document(self) -> dict:
        return replay_json(self.result)
