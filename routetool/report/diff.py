"""Render a :class:`~routetool.analysis.diff.DiffResult`: the answer first, then the worst layers;
``--details`` every table and the first differing rows; the JSON document; the agreement plot."""

from __future__ import annotations

import os
from pathlib import Path

from rich.text import Text

from routetool.analysis.diff import MAX_TOKENS_LISTED

from routetool.report.partial import partial_json, render_partial
from routetool.report.tables import _values, _weights, fmt_float, table, user_text


def headline(result) -> str:
    """The first line: ``IDENTICAL (...)`` or ``DIFFERENT (n of m token-layers; k outside near-ties)``
    (rows of other experts where no logits judge near-ties are said to be not judged)."""
    m = result.rows
    if result.identical:
        n = len(result.layers)
        return f"IDENTICAL ({m:,} token-layers, {n} layer{'' if n == 1 else 's'})"
    unjudged = result.margins.not_judged  # other experts with no margin (no logits, or padded on one side)
    judged = result.outside_ties - unjudged
    if not unjudged:
        ties = f"{judged:,} outside near-ties"
    elif not judged:
        ties = f"{unjudged:,} with other experts, not judged for near-ties"
    else:
        ties = f"{judged:,} outside near-ties, {unjudged:,} not judged"
    text = f"DIFFERENT ({result.differing:,} of {m:,} token-layers; {ties})"
    if result.tolerated:
        text += ": within the thresholds (" + _thresholds(result) + ")"
    return text


def _thresholds(result) -> str:
    parts = []
    if result.ignore_ties:
        parts.append("--ignore-ties")
    if result.ignore_order:
        parts.append("--ignore-order")
    if result.max_flip_rate is not None:
        parts.append(f"--max-flip-rate {result.max_flip_rate:g}: {result.counted:,} counted")
    return ", ".join(parts)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _breakdown(result) -> str:
    c = result.count
    return (f"classes: {c('same'):,} same, {c('weights'):,} weights only, {c('order'):,} slot-order flips, "
            f"{c('tie'):,} other experts inside near-ties, {c('real'):,} other experts outside near-ties"
            + ("" if result.ties_judged else " (no logits: ties not judged)"))


def _layer_table(result, layers, title: str = "Agreement by layer", weights: bool = True) -> object:
    columns = ["layer", "rows", "same", "set agree", "overlap@k", "order flips", "tie", "real"]
    t = table(title, columns + (["max|Δw|", "max Δw ulps"] if weights else []) + ["first div"])
    for x in layers:
        cells = [str(x.layer), f"{x.rows:,}", _pct(x.agreement), _pct(x.set_agreement), _pct(x.overlap(result.topk)),
                 f"{x.classes['order']:,}", f"{x.classes['tie']:,}", f"{x.classes['real']:,}"]
        if weights:
            cells += [fmt_float(x.weight_max) if x.weight_rows else "-",
                      f"{x.weight_max_ulps:.0f}" if x.weight_rows else "-"]
        t.add_row(*cells, f"{x.first_divergence:,}")
    return t


def render_diff(result, console, *, details: bool = False) -> None:
    """Print ``result``: the verdict line first, then the measures and the worst layers
    (``details``: every layer and the first differing rows)."""
    render_partial(result.partial, console)  # (before anything: a verdict on part of a recording)
    console.print(Text(headline(result)), soft_wrap=True)
    console.print(user_text(f"A {result.source_a} ({result.holds_a})"), soft_wrap=True)
    console.print(user_text(f"B {result.source_b} ({result.holds_b})"), soft_wrap=True)
    console.print(Text(_breakdown(result)))
    over = [f"set agreement {_pct(_ratio(result.total('same_set'), result.rows))}",
            f"overlap@{result.topk} {_pct(_ratio(result.total('overlap_sum'), result.rows * result.topk))}"]
    if result.weights_compared:
        wc = result.total("weight_count")
        over.append(f"weights max|Δw| {fmt_float(max((x.weight_max for x in result.layers), default=0.0))}, mean "
                    f"{fmt_float(result.total('weight_sum') / wc if wc else None)}, max "
                    f"{max((x.weight_max_ulps for x in result.layers), default=0.0):.0f} ulps")
    if result.tokens is not None:
        over.append(f"tokens differing in at least one layer {result.tokens_differing:,} of {result.tokens:,} "
                    f"({_pct(_ratio(result.tokens_differing, result.tokens))})")
    console.print(Text("; ".join(over)))
    for note in result.notes:
        console.print(user_text(f"note: {note}"))
    if details:
        console.print(_layer_table(result, result.layers))
        by_request = result.align == "requests"
        if result.examples:
            where = ["request", "position"] if by_request else []
            t = table("First differing rows", ["rank", "layer", "step", "row", *where, "class", "ids A", "ids B",
                                               "weights A", "weights B"],
                      left=("request", "class", "ids A", "ids B", "weights A", "weights B"))
            for e in result.examples:
                at = [user_text(e.request), str(e.position)] if by_request else []
                t.add_row(_rank(e.rank), str(e.layer), str(e.step), str(e.row), *at, e.cls,
                          _values(e.ids_a), _values(e.ids_b), _weights(e.weights_a), _weights(e.weights_b))
            console.print(t)
        if result.first_tokens:
            where = ["request", "position"] if by_request else []
            t = table(f"First divergence by token (first {len(result.first_tokens):,} of {result.tokens_differing:,} "
                      "tokens differing)", ["rank", "token", "step", "row", *where, "first layer"], left=("request",))
            for x in result.first_tokens:
                at = [user_text(x.request), str(x.position)] if by_request else []
                t.add_row(_rank(x.rank), f"{x.token:,}", str(x.step), str(x.row), *at, str(x.layer))
            console.print(t)
        margins = _margin_rows(result)
        if any(row["tie"] or row["real"] for row in margins) or result.margins.not_judged:
            t = table(f"Other experts by margin at the k-th pick (float32 ulps of the k-th key; near-tie: at most "
                      f"{result.tie_ulps:g})", ["margin (ulps)", "tie", "real"])
            for row in margins:
                if row["tie"] or row["real"]:
                    t.add_row(_bin(row), f"{row['tie']:,}", f"{row['real']:,}")
            if result.margins.not_judged:
                t.add_row("not judged", "0", f"{result.margins.not_judged:,}")
            console.print(t)
    else:
        worst = result.worst_layers()
        if worst:
            console.print(_layer_table(result, worst, f"Worst layers ({len(worst)} of {len(result.layers)}, by "
                                       "real disagreements, then share differing)", weights=False))
        console.print(Text("--details: every layer and the first differing rows; --json for all numbers"))


def _rank(rank) -> str:
    return "-" if rank is None else str(rank)


def _margin_rows(result) -> list[dict]:
    """The margin histogram (:class:`~routetool.analysis.diff.Margins`) as JSON rows: each bin's
    ``low_ulps`` and ``high_ulps`` (None: unbounded) and its ``tie`` and ``real`` rows."""
    m = result.margins
    return [{"low_ulps": lo, "high_ulps": None if hi == float("inf") else hi, "tie": t, "real": r}
            for (lo, hi), t, r in zip(m.bins(), m.tie, m.real)]


def _bin(row: dict) -> str:
    lo, hi = row["low_ulps"], row["high_ulps"]
    if hi == 0:
        return "0 (exact tie)"
    return f"> {lo:,.0f}" if hi is None else f"({lo:,.0f}, {hi:,.0f}]"


def _ratio(a: int | None, b: int | None) -> float | None:
    return a / b if a is not None and b else None


def diff_json(result) -> dict:
    """The JSON document (keys name their units; shares are fractions in [0, 1])."""
    def layer(x):
        return {
            "layer": x.layer, "rows": x.rows, "padded_rows": x.padded, "classes": dict(x.classes),
            "agreement": x.agreement, "set_agreement": x.set_agreement, "overlap_at_k": x.overlap(result.topk),
            "slot_order_flips": x.classes["order"], "near_tie_differences": x.classes["tie"],
            "real_differences": x.classes["real"], "weight_rows": x.weight_rows,
            "weight_max_abs_delta": x.weight_max if x.weight_rows else None,
            "weight_mean_abs_delta": x.weight_mean, "weight_max_delta_ulps": x.weight_max_ulps if x.weight_rows
            else None, "first_divergence_tokens": x.first_divergence,
        }
    wc = result.total("weight_count")
    return {
        "command": "diff",
        "verdict": result.verdict,
        "tolerated": result.tolerated,
        "exit_code": result.exit_code,
        "headline": headline(result),
        "a": {"source": result.source_a, "holds": result.holds_a},
        "b": {"source": result.source_b, "holds": result.holds_b},
        "num_experts": result.num_experts, "topk": result.topk, "align": result.align, "kernel": result.kernel,
        "kernel_b": result.kernel_b,
        "tie_ulps": result.tie_ulps, "weight_ulps": result.weight_ulps,
        "thresholds": {"ignore_ties": result.ignore_ties, "ignore_order": result.ignore_order,
                       "max_flip_rate": result.max_flip_rate},
        "overall": {
            "token_layers": result.rows, "differing": result.differing, "outside_near_ties": result.outside_ties,
            "counted": result.counted, "classes": {c: result.count(c) for c in ("same", "weights", "order", "tie", "real")},
            "set_agreement": _ratio(result.total("same_set"), result.rows),
            "overlap_at_k": _ratio(result.total("overlap_sum"), result.rows * result.topk),
            "weight_max_abs_delta": max((x.weight_max for x in result.layers), default=None)
            if result.weights_compared else None,
            "weight_mean_abs_delta": result.total("weight_sum") / wc if wc else None,
            "weight_max_delta_ulps": max((x.weight_max_ulps for x in result.layers), default=None)
            if result.weights_compared else None,
            "ties_judged": result.ties_judged,
            "tokens": result.tokens, "tokens_differing": result.tokens_differing,
            "tokens_differing_share": _ratio(result.tokens_differing, result.tokens),
        },
        "layers": [layer(x) for x in result.layers],
        "first_differing_rows": [
            {"rank": e.rank, "layer": e.layer, "step": e.step, "row": e.row, "request": e.request,
             "position": e.position, "class": e.cls, "ids_a": e.ids_a, "ids_b": e.ids_b, "weights_a": e.weights_a,
             "weights_b": e.weights_b}
            for e in result.examples],
        "first_divergence": {
            "tokens_differing": result.tokens_differing, "listed_at_most": MAX_TOKENS_LISTED,
            "listed": [{"rank": x.rank, "token": x.token, "step": x.step, "row": x.row, "request": x.request,
                        "position": x.position, "layer": x.layer} for x in result.first_tokens]},
        "margins": {
            "unit": "float32 ulps of the k-th largest selection key", "tie_ulps": result.tie_ulps,
            "near_tie": result.count("tie"), "real": result.count("real"),
            "not_judged": result.margins.not_judged, "bins": _margin_rows(result)},
        "notes": list(result.notes),
        **partial_json(result.partial),
    }


def write_diff_plot(result, path: str | os.PathLike) -> Path:
    """A PNG of agreement (same class) and set agreement by layer, written atomically.

    Raises:
        RouteToolError: matplotlib missing, or the figure cannot be written.
    """
    from routetool.report.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(result.layers) + 2), 3.2))
    xs = [x.layer for x in result.layers]
    ax.plot(xs, [100 * (x.agreement or 0) for x in result.layers], marker="o", label="same (ids, slots, weights)")
    ax.plot(xs, [100 * (x.set_agreement or 0) for x in result.layers], marker="s", label="same set of experts")
    ax.set_xlabel("layer")
    ax.set_ylabel("token-layers agreeing (%)")
    ax.set_ylim(0, 101)
    ax.set_title(headline(result)[:90], fontsize=8)
    ax.legend(fontsize=7)
    path = Path(path)
    _save(fig, path, plt)
    return path


class DiffReport:
    """diff's report (:class:`routetool.report.protocol.Report`): exit code from the result (0
    identical or within the thresholds, 1 different); ``figure()`` for ``--plot``."""

    def __init__(self, result) -> None:
        self.result = result

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    def terminal(self, console, details: bool = False) -> None:
        render_diff(self.result, console, details=details)

    def document(self) -> dict:
        return diff_json(self.result)

    def figure(self, path: str | os.PathLike) -> Path:
        return write_diff_plot(self.result, path)
