"""Reporters of ``routetool balance`` and ``routetool import``: rich tables, terminal bars,
JSON documents. Nothing here computes results (see :mod:`routetool.analysis.balance`).
"""

from __future__ import annotations

from dataclasses import asdict

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from routetool.analysis.balance import BalanceResult, LayerBalance, Quantiles
from routetool.analysis.eplb import placement_document
from routetool.errors import EXIT_OK
from routetool.io.dumps import ImportedCounts, ImportedRouting
from routetool.report.formats import idle_layer_expert_pairs, load_json
from routetool.report.partial import partial_json, render_partial
from routetool.report.tables import fmt_float, histogram_renderable, table, user_text

BALANCE_SCHEMA = "routetool.balance/1"
_LEVELS = "▁▂▃▄▅▆▇█"
_MAX_LAYER_ROWS = 64


def _f(value: float | None, digits: int = 3) -> str:
    return fmt_float(value, digits) if value is not None else "-"


def _f3(value: float | None) -> str:
    """A value in [0, 1] (balancedness) with 3 decimals, so that numbers side by side line up."""
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _bal(value: float | None) -> Text:
    """Balancedness coloured: green >= 0.9, yellow >= 0.7, red below."""
    if value is None:
        return Text("-", style="dim")
    style = "green" if value >= 0.9 else ("yellow" if value >= 0.7 else "red")
    return Text(f"{value:.3f}", style=style)


def _spark(values: list[float | None], lo: float | None = None, hi: float | None = None) -> Text:
    """One block per value between ``lo`` and ``hi`` (default: their min and max; None is ``·``).
    All equal: full blocks, or the lowest where they are all 0 (no load is not a full bar)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return Text("-", style="dim")
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    out = Text()
    for v in values:
        if v is None:
            out.append("·", style="dim")
            continue
        level = (7 if v else 0) if hi <= lo else round(7 * (v - lo) / (hi - lo))
        out.append(_LEVELS[max(0, min(7, level))], style="cyan")
    return out


def _bar(value: float, peak: float, width: int = 30, style: str = "cyan") -> Text:
    n = round(width * value / peak) if peak > 0 else 0
    t = Text("█" * n, style=style)
    t.append("░" * (width - n), style="dim")
    return t


def _focus(x: LayerBalance, layer: int | None) -> str | None:
    """Row style of ``x`` in a per-layer table: bold for the layer shown in detail (``--layer``)."""
    return "bold" if x.layer == layer else None


def rank_bars(assignments: list[float], title: str, tokens_received: list[int] | None = None) -> Panel:
    """Assignments per EP rank as horizontal bars (the hottest in red)."""
    peak = max(assignments) if assignments else 0.0
    total = sum(assignments)
    mean = total / len(assignments) if assignments else 0.0
    lines = []
    for r, a in enumerate(assignments):
        line = Text(f"EP {r:>3} ")
        line.append_text(_bar(a, peak, 40, "red" if a == peak and peak > 0 else "cyan"))
        line.append(f" {a:,.0f}")
        if tokens_received is not None:
            line.append(f"  ({tokens_received[r]:,} tokens)", style="dim")
        lines.append(line)
    foot = Text(f"mean {mean:,.1f} assignments/EP rank, max {peak:,.0f}; balancedness "
                + (f"{mean / peak:.3f}" if peak else "- (no assignments)"), style="dim")
    return Panel(Group(*lines, foot), title=title, expand=False)


def heat_strip(result: BalanceResult, width: int = 128) -> Panel:
    """Layer x expert load as block characters (height = load / mean of the layer)."""
    E = result.num_experts
    per = max(1, -(-E // width))
    rows = result.layers[:_MAX_LAYER_ROWS]
    peak = 0.0
    grid = []
    for x in rows:
        mean = x.load.mean_load or 1.0
        bins = [max(x.counts[i:i + per]) / mean for i in range(0, E, per)]
        grid.append(bins)
        peak = max(peak, max(bins))
    lines = []
    for x, bins in zip(rows, grid):
        line = Text(f"L{x.layer:<4}")
        for v in bins:
            if v == 0:
                line.append("·", style="dim red")
            else:
                lvl = max(0, min(7, round(7 * v / peak))) if peak else 0
                line.append(_LEVELS[lvl], style="red" if v >= 2 else "cyan")
        line.append(f" {x.load.imbalance:.2f}" if x.load.imbalance is not None else " -", style="dim")
        lines.append(line)
    note = ("one column per expert" if per == 1 else f"one column per {per} experts (their max)")
    lines.append(Text(f"{note}; height = tokens / layer mean (tallest = {peak:.2f}x); red >= 2x mean; · idle; "
                      "right: max/mean" + (f"; first {_MAX_LAYER_ROWS} layers" if len(result.layers) > _MAX_LAYER_ROWS else ""),
                      style="dim"))
    return Panel(Group(*lines), title="Expert load per layer (layer x expert)", expand=False)


WORST_SHOWN = 5
"""Layers in the summary's table of worst layers."""


def render_balance(result: BalanceResult, console: Console, layer: int | None = None, details: bool = False) -> None:
    """Print the balance report.

    By default a summary that fits one screen whatever the number of layers: the header, the
    answer (expert imbalance, EP balancedness, what EPLB would buy, capacity drops, each with
    its worst layer), the worst layers in one table, the notes and a pointer to ``--details``.
    ``details``: every per-layer table (expert load, EP ranks, EPLB, bias, capacity, drift) and
    the charts. ``layer`` (``--layer L``) adds that layer's detail either way.
    """
    render_partial(result.partial, console)  # (before anything: a verdict on part of a recording)
    _header(result, console)
    if details:
        _render_details(result, console, layer)
        _rank_table(result, console)
    else:
        _render_summary(result, console, layer)
        _rank_line(result, console)
    for note in result.notes:
        console.print(user_text("• " + note, style="yellow"))
    if not details:
        console.print(Text("--details: every layer's tables (expert load, EP ranks, EPLB, bias, capacity, drift) and "
                           "the charts; --json for all numbers", style="dim"))


def _rank_line(result: BalanceResult, console: Console) -> None:
    """A run folder's ranks in one line: how far each rank's own expert load is from the global one."""
    if not result.ranks or len(result.ranks) < 2:
        return
    worst = max(result.ranks, key=lambda r: r.imbalance if r.imbalance is not None else -1.0)
    far = max(result.ranks, key=lambda r: r.tv_from_global if r.tv_from_global is not None else -1.0)
    big = max(result.ranks, key=lambda r: r.share if r.share is not None else -1.0)
    console.print(Text(f"ranks ({len(result.ranks)} summed): own max/mean up to {_f(worst.imbalance)} (rank-{worst.rank}); "
                       f"largest share {_pct(big.share)} (rank-{big.rank}); TV distance from the global load up to "
                       f"{_f(far.tv_from_global)} (rank-{far.rank})"))


def _rank_table(result: BalanceResult, console: Console) -> None:
    if not result.ranks:
        return
    t = table("Per rank: each data-parallel rank's own load (all analysed layers)",
              ["rank", "role", "assign", "share", "max/mean", "CV", "hottest", "TV from global"], left=("rank", "role"))
    for r in result.ranks:
        t.add_row(f"rank-{r.rank}", r.role or "-", f"{r.assignments:,}", _pct(r.share), _f(r.imbalance), _f(r.cv),
                  "-" if r.hottest is None else str(r.hottest), _f(r.tv_from_global))
    console.print(t)


def _worst(values: list[tuple[int, float | None]], highest: bool) -> tuple[int, float] | None:
    known = [(layer, v) for layer, v in values if v is not None]
    if not known:
        return None
    return max(known, key=lambda x: x[1]) if highest else min(known, key=lambda x: x[1])


def _median(values: list[float | None]) -> float | None:
    """The median of the known values (the mean of the two middle ones for an even count)."""
    import statistics

    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _render_summary(result: BalanceResult, console: Console, layer: int | None) -> None:
    """The answer, then the worst layers (see :func:`render_balance`)."""
    layers = result.layers
    several = len(layers) > 1
    lines = []
    imb = [(x.layer, x.load.imbalance) for x in layers]
    worst = _worst(imb, highest=True)
    tl = result.total_load
    text = f"experts: max/mean {_f(_median([v for _, v in imb]))}"
    if several:
        text = (f"experts: max/mean {_f(_median([v for _, v in imb]))} median over {len(layers)} layers"
                + (f" (worst L{worst[0]}: {_f(worst[1])})" if worst else "") + f"; all layers summed {_f(tl.imbalance)}")
    lines.append(text + f"; idle layer-expert pairs {idle_layer_expert_pairs(x.load for x in layers):,}")
    for ep in result.ep:
        q = ep.balancedness
        lines.append(f"EP {ep.placement}: balancedness {_f(q.mean)}" + (" mean over layers" if several else "")
                     + (f" (worst L{ep.worst_layer}: {_f(q.min)})" if several and ep.worst_layer is not None else "")
                     + f"; per step {_f(ep.step_balancedness_mean)}")
    if result.eplb is not None:
        e = result.eplb
        text = (f"EPLB what-if ({e.num_gpus} GPUs, {e.num_redundant} redundant): balancedness"
                + (" mean over layers" if several else "")
                + f", in-sample {_f3(e.summary_before.mean)} -> {_f3(e.summary_after.mean)}")
        hb, ha = e.holdout_before, e.holdout_after
        if hb is not None and ha is not None and hb.count and ha.count:
            text += f"; held-out half {_f3(hb.mean)} -> {_f3(ha.mean)}"
            if e.pays_held_out is False:
                text += ": EPLB does not pay out of sample"
        else:
            text += "; held-out: needs 2 windows or more"
        lines.append(text)
    if result.capacity_factors:
        parts = []
        for j, f in enumerate(result.capacity_factors):
            dropped = sum(x.capacity[j].dropped for x in layers)
            total = sum(x.assignments for x in layers)
            parts.append(f"cf {f:g}: {_pct(dropped / total) if total else '-'}")
        lines.append("capacity drops: " + ", ".join(parts) + " of assignments")
    biased = [x for x in layers if x.bias is not None]
    if biased:
        w = _median([x.bias.load_with.imbalance for x in biased])
        wo = _median([x.bias.load_without.imbalance for x in biased])
        if all(x.bias.changed_fraction == 0 for x in biased):  # (a bias of zeros, or too small to matter)
            lines.append(f"router bias: changes no pick (max/mean {_f(w)} either way, median over layers)")
        else:
            lines.append(f"router bias: max/mean {_f(wo)} without it, {_f(w)} with it (median over layers)")
    else:
        lines.append(f"router bias effect: {result.bias_note}")
    for line in lines:
        console.print(Text(line))
    if not several and layer is None:
        return
    ep0 = 0 if result.ep else None
    by_eplb = {y.layer: y for y in result.eplb.layers} if result.eplb is not None else {}
    if ep0 is not None:
        order = sorted(layers, key=lambda x: (x.ranks[ep0].balancedness is None,
                                              x.ranks[ep0].balancedness if x.ranks[ep0].balancedness is not None
                                              else 0.0))
        by = f"lowest balancedness at {result.ep[ep0].placement}"
    else:
        order = sorted(layers, key=lambda x: -(x.load.imbalance or 0.0))
        by = "highest max/mean"
    shown = order[:WORST_SHOWN]
    if layer is not None and all(x.layer != layer for x in shown):
        shown += [x for x in layers if x.layer == layer]
    cols = ["layer", "max/mean", "CV", "idle", "hottest e:share"]
    if ep0 is not None:
        cols.append("bal")
    if by_eplb:
        cols.append("EPLB")
    if result.capacity_factors:
        cols.append(f"drop cf {result.capacity_factors[0]:g}")
    t = table(f"Worst layers ({len(shown)} of {len(layers)}, by {by})", cols, left=("hottest e:share",))
    for x in shown:
        hot = x.load.hottest[0] if x.load.hottest else None
        cells = [str(x.layer), _f(x.load.imbalance), _f(x.load.cv), str(len(x.load.idle)),
                 f"{hot[0]}:{_pct(hot[1] / x.assignments)}" if hot and x.assignments else "-"]
        if ep0 is not None:
            cells.append(_bal(x.ranks[ep0].balancedness))
        if by_eplb:
            cells.append(_bal(by_eplb[x.layer].balancedness_after))
        if result.capacity_factors:
            cells.append(_pct(x.capacity[0].dropped_fraction))
        t.add_row(*cells, style=_focus(x, layer))
    console.print(t)


def _header(result: BalanceResult, console: Console) -> None:
    header = Table.grid(padding=(0, 2))
    header.add_row("input", user_text(f"{result.source} ({result.kind})"))
    header.add_row("model", user_text(result.model or "-"))
    header.add_row("routing", user_text(result.routing))
    counted = _counted(result)
    header.add_row("experts", f"E={result.num_experts} topk={result.topk if result.topk else '?'}; "
                              f"{len(result.layers)} layer(s); "
                              + (f"{counted['tokens']:,} tokens, " if counted["tokens"] is not None else "")
                              + f"{counted['assignments']:,} assignments")
    rate = counted["rows_per_s"]
    header.add_row("statistics", f"on {result.device}, {result.elapsed_s:.2f} s"
                                 + (f"; {counted['rows']:,} rows, {rate:,.0f} rows/s" if rate else "")
                                 + (f"; {result.world_size} processes (torchrun)" if result.world_size > 1 else ""))
    console.print(Panel(header, title="routetool balance", expand=False))


def _counted(result: BalanceResult) -> dict:
    """What the statistics counted, as the header prints it and the JSON holds it: ``rows``, the
    token rows of every analysed layer (a token counts once per layer, padding included);
    ``tokens``, those of them that are not padding (None for counts, which have no rows);
    ``assignments``, token-expert picks; ``rows_per_s``, rows analysed per second of
    ``elapsed_s`` (None for counts)."""
    rows = result.kind != "counts"
    tokens = [x.tokens for x in result.layers]
    return {
        "rows": result.rows if rows else None,
        "tokens": sum(tokens) if rows and None not in tokens else None,
        "assignments": sum(x.assignments for x in result.layers),
        "rows_per_s": result.token_layers_per_s if rows else None,
    }


def _render_details(result: BalanceResult, console: Console, layer: int | None) -> None:
    """Every per-layer table (with its ``all``/``layers``/``mean`` row when there are several) and the
    charts; ``layer`` (``--layer L``) adds that layer's detail: its row in bold, its EPLB placement per
    GPU, its windows, its expert and rank bars."""
    several = len(result.layers) > 1
    focus = next((x for x in result.layers if x.layer == layer), None) if layer is not None else None
    # expert load
    t = table("Expert load per layer (assignments = token-expert pairs)",
               ["layer", "steps", "tokens", "assign", "max/mean", "CV", "entropy", "Gini", "idle", "hottest e:assign"],
               left=("hottest e:assign",))
    for x in result.layers:
        hot = ", ".join(f"{e}:{c:,}" for e, c in x.load.hottest)
        t.add_row(str(x.layer), str(x.num_steps), f"{x.tokens:,}" if x.tokens is not None else "-",
                  f"{x.assignments:,}", _f(x.load.imbalance), _f(x.load.cv), _f(x.load.normalized_entropy),
                  _f(x.load.gini), str(len(x.load.idle)), hot, style=_focus(x, layer))
    if several:
        tl = result.total_load
        t.add_row(Text("all", style="bold"), "", "", f"{tl.assignments:,}", _f(tl.imbalance), _f(tl.cv),
                  _f(tl.normalized_entropy), _f(tl.gini), str(len(tl.idle)),
                  ", ".join(f"{e}:{c:,}" for e, c in tl.hottest), end_section=True)
    console.print(t)

    # EP ranks
    for i, ep in enumerate(result.ep):
        t = table(f"EP ranks: {ep.placement} (balancedness = mean/max assignments per rank)",
                   ["layer", "balancedness", "step min", "p10", "p50", "p90", "mean", "hottest EP", "share",
                    "EP loads"], left=("EP loads",))
        for x in result.layers:
            r = x.ranks[i]
            q = r.step_balancedness
            t.add_row(str(x.layer), _bal(r.balancedness), _f(q.min), _f(q.p10), _f(q.p50), _f(q.p90), _f(q.mean),
                      str(r.hottest_rank) if r.hottest_rank is not None else "-", _pct(r.hottest_share), _spark(r.assignments, lo=0.0),
                      style=_focus(x, layer))
        if several:
            q = ep.balancedness
            t.add_row(Text("layers", style="bold"), _bal(q.mean), _f(q.min), _f(q.p10), _f(q.p50), _f(q.p90),
                      _f(ep.step_balancedness_mean), f"worst L{ep.worst_layer}" if ep.worst_layer is not None else "-",
                      "", "", end_section=True)
        console.print(t)
        if several:
            console.print(Text("'layers' row: mean, min, p10, p50, p90 of the per-layer balancedness; its 'mean' "
                               "column: mean per-step balancedness over layers (SGLang's average balancedness)",
                               style="dim"))

    # EPLB
    if result.eplb is not None:
        e = result.eplb
        t = table(f"EPLB what-if ({e.policy}): {e.num_gpus} GPUs, {e.num_nodes} node(s), {e.num_groups} group(s), "
                   f"{e.num_redundant} redundant experts",
                   ["layer", "before", "after", "max rank before", "after", "windows before", "after",
                    "holdout before", "after", "replicated e×n"], left=("replicated e×n",))
        by_layer = {x.layer: x for x in e.layers}
        for x in result.layers:
            y = by_layer[x.layer]
            rep = ", ".join(f"{le}×{n}" for le, n in y.replicated[:6]) + (" ..." if len(y.replicated) > 6 else "")
            t.add_row(str(y.layer), _bal(y.balancedness_before), _bal(y.balancedness_after),
                      f"{y.max_rank_load_before:,.0f}", f"{y.max_rank_load_after:,.0f}",
                      _bal(y.window_balancedness_before), _bal(y.window_balancedness_after),
                      _bal(y.holdout_before), _bal(y.holdout_after), rep or "-", style=_focus(x, layer))
        if several:
            t.add_row(Text("mean", style="bold"), _bal(e.summary_before.mean), _bal(e.summary_after.mean),
                      "", "", "", "", "", "", "", end_section=True)
        console.print(t)
        console.print(Text("before: contiguous placement on the same GPUs; after: EPLB fitted on this traffic "
                           "(in-sample); windows: mean over windows; holdout: fitted on the first half of the windows, "
                           "measured on the second", style="dim"))
        if focus is not None:
            p = e.placement
            y = by_layer[focus.layer]
            phy = p.physical_to_logical[p.row(focus.layer)].tolist()
            cnt = p.logical_count[p.row(focus.layer)].tolist()
            per = p.experts_per_gpu
            pt = table(f"EPLB placement of layer {focus.layer} (physical slots per GPU; e×n = expert with n replicas)",
                        ["GPU", "load before", "after", "logical experts in its slots"],
                        left=("logical experts in its slots",))
            for g in range(p.num_gpus):
                slots = phy[g * per:(g + 1) * per]
                names = ", ".join(f"{le}×{cnt[le]}" if cnt[le] > 1 else str(le) for le in slots)
                pt.add_row(str(g), f"{y.rank_load_before[g]:,.0f}", f"{y.rank_load_after[g]:,.1f}", names)
            console.print(pt)
    elif result.eplb_note:
        console.print(Text(f"EPLB: {result.eplb_note}", style="dim"))

    # bias
    biased = [x for x in result.layers if x.bias is not None]
    if biased:
        t = table("Router bias effect: routed with the trace's bias vs bias zeroed",
                   ["layer", "max/mean bias", "zeroed", "CV bias", "zeroed", "balancedness bias", "zeroed",
                    "step mean bias", "zeroed", "picks changed"])
        for x in biased:
            b = x.bias
            t.add_row(str(x.layer), _f(b.load_with.imbalance), _f(b.load_without.imbalance), _f(b.load_with.cv),
                      _f(b.load_without.cv), _bal(b.balancedness_with), _bal(b.balancedness_without),
                      _bal(b.step_balancedness_with), _bal(b.step_balancedness_without), _pct(b.changed_fraction),
                      style=_focus(x, layer))
        console.print(t)
        console.print(Text(f"bias effect: {result.bias_note}; balancedness at {result.ep[0].placement}"
                           if result.ep else f"bias effect: {result.bias_note}", style="dim"))
    else:
        console.print(Text(f"Router bias effect: {result.bias_note}", style="yellow"))

    # capacity
    if result.capacity_factors:
        cols = ["layer"]
        for f in result.capacity_factors:
            cols += [f"cf {f:g} dropped", "experts", "steps"]
        t = table("Capacity overflow: assignments over ceil(cf x assignments / E) per expert and step", cols)
        for x in result.layers:
            cells = [str(x.layer)]
            for c in x.capacity:
                cells += [Text(f"{c.dropped:,} ({_pct(c.dropped_fraction)})", style="red" if c.dropped else "dim"),
                          str(c.experts_overflowing), str(c.steps_overflowing)]
            t.add_row(*cells, style=_focus(x, layer))
        console.print(t)

    # drift
    t = table("Drift: prefill vs decode, and over windows of consecutive steps",
               ["layer", "prefill max/mean", "bal", "decode max/mean", "bal", "TV(prefill,decode)",
                "windows", "max/mean per window", "max TV vs layer"], left=("max/mean per window",))
    for x in result.layers:
        ph = {p.phase: p for p in x.phases}
        pre, dec = ph.get("prefill"), ph.get("decode")
        tvs = [w.tv_distance for w in x.windows if w.tv_distance is not None]
        t.add_row(str(x.layer), _f(pre.imbalance) if pre else "-", _bal(pre.balancedness) if pre else Text("-"),
                  _f(dec.imbalance) if dec else "-", _bal(dec.balancedness) if dec else Text("-"),
                  _f(x.phase_tv_distance), str(len(x.windows)), _spark([w.imbalance for w in x.windows]),
                  _f(max(tvs)) if tvs else "-", style=_focus(x, layer))
    console.print(t)
    if focus is not None:
        x = focus
        wt = table(f"Windows of layer {x.layer}", ["window", "steps", "tokens", "assign", "max/mean", "CV",
                                                    "balancedness", "TV vs layer", "top expert"])
        for w in x.windows:
            wt.add_row(w.label, f"{w.last_step - w.first_step + 1}", f"{w.tokens:,}" if w.tokens is not None else "-",
                       f"{w.assignments:,}", _f(w.imbalance), _f(w.cv), _bal(w.balancedness), _f(w.tv_distance),
                       str(w.top_expert) if w.top_expert is not None else "-")
        console.print(wt)

    # bars: all layers, then the --layer in detail
    console.print(heat_strip(result))
    console.print(histogram_renderable(result.total_counts, "Expert load, all layers summed (assignments)"))
    if result.ep:
        tot = [sum(x.ranks[0].assignments[r] for x in result.layers) for r in range(result.ep[0].num_ranks)]
        console.print(rank_bars(tot, f"EP rank load, all layers summed ({result.ep[0].placement})"))
    if focus is not None:
        console.print(histogram_renderable(focus.counts, f"Expert load, layer {focus.layer} (assignments)"))
        for r in focus.ranks:
            console.print(rank_bars(r.assignments, f"EP rank load, layer {focus.layer} ({r.placement})",
                                    r.tokens_received))
    if result.eplb is not None and several:
        lines = []
        # two bars per line, each up to 25 cells: narrower on a narrow terminal so that a
        # layer stays on one line (labels, values and the panel's border take 37 cells)
        width = max(8, min(25, (console.width - 37) // 2))
        for y in result.eplb.layers[:_MAX_LAYER_ROWS]:
            line = Text(f"L{y.layer:<4} before ")
            line.append_text(_bar(y.balancedness_before or 0.0, 1.0, width, "yellow"))
            line.append(f" {_f(y.balancedness_before)}  after ")
            line.append_text(_bar(y.balancedness_after or 0.0, 1.0, width, "green"))
            line.append(f" {_f(y.balancedness_after)}")
            lines.append(line)
        console.print(Panel(Group(*lines), title="Balancedness per layer, before / after EPLB (1.0 = even)",
                            expand=False))


# ---------------------------------------------------------------------------------------
# JSON
def _quantiles(q: Quantiles) -> dict:
    return asdict(q)


def _layer(x: LayerBalance) -> dict:
    return {
        "layer": x.layer,
        "num_steps": x.num_steps,
        "tokens": x.tokens,
        "assignments": x.assignments,
        "uncounted_ids": x.uncounted,
        "expert_counts_assignments": x.counts,
        "load": load_json(x.load, "assignments"),
        "ranks": [
            {
                "placement": r.placement,
                "num_ranks": r.num_ranks,
                "rank_assignments": r.assignments,
                "rank_tokens_received": r.tokens_received,
                "balancedness_mean_over_max": r.balancedness,
                "step_balancedness": _quantiles(r.step_balancedness),
                "hottest_rank": r.hottest_rank,
                "hottest_rank_share": r.hottest_share,
            }
            for r in x.ranks
        ],
        "phases": [
            {"phase": p.phase, "steps": p.steps, "tokens": p.tokens, "assignments": p.assignments,
             "imbalance_max_over_mean": p.imbalance, "cv": p.cv, "balancedness_mean_over_max": p.balancedness,
             "step_balancedness_mean": p.step_balancedness_mean, "top_expert": p.top_expert}
            for p in x.phases
        ],
        "phase_tv_distance": x.phase_tv_distance,
        "windows": [
            {"window": w.index, "label": w.label, "first_step": w.first_step, "last_step": w.last_step,
             "tokens": w.tokens, "assignments": w.assignments, "imbalance_max_over_mean": w.imbalance, "cv": w.cv,
             "balancedness_mean_over_max": w.balancedness, "tv_distance_from_layer": w.tv_distance,
             "top_expert": w.top_expert}
            for w in x.windows
        ],
        "capacity": [
            {"capacity_factor": c.factor, "dropped_assignments": c.dropped, "dropped_fraction": c.dropped_fraction,
             "experts_overflowing": c.experts_overflowing, "steps_overflowing": c.steps_overflowing,
             "overflow_assignments_per_expert": c.overflow}
            for c in x.capacity
        ],
        "bias_effect": None if x.bias is None else {
            "expert_counts_with_bias_assignments": x.bias.counts_with,
            "expert_counts_bias_zeroed_assignments": x.bias.counts_without,
            "load_with_bias": load_json(x.bias.load_with, "assignments"),
            "load_bias_zeroed": load_json(x.bias.load_without, "assignments"),
            "balancedness_with_bias": x.bias.balancedness_with,
            "balancedness_bias_zeroed": x.bias.balancedness_without,
            "step_balancedness_mean_with_bias": x.bias.step_balancedness_with,
            "step_balancedness_mean_bias_zeroed": x.bias.step_balancedness_without,
            "changed_picks_fraction": x.bias.changed_fraction,
        },
    }


def balance_json(result: BalanceResult, include_placement: bool = True) -> dict:
    """The balance result as the documented JSON document (docs/balance.md)."""
    import torch

    eplb = None
    if result.eplb is not None:
        e = result.eplb
        eplb = {
            "policy": e.policy,
            "num_redundant_experts": e.num_redundant,
            "num_gpus": e.num_gpus,
            "num_nodes": e.num_nodes,
            "num_groups": e.num_groups,
            "balancedness_before": _quantiles(e.summary_before),
            "balancedness_after": _quantiles(e.summary_after),
            "holdout_balancedness_before": None if e.holdout_before is None else _quantiles(e.holdout_before),
            "holdout_balancedness_after": None if e.holdout_after is None else _quantiles(e.holdout_after),
            "pays_held_out": e.pays_held_out,
            "layers": [
                {"layer": y.layer, "balancedness_before": y.balancedness_before,
                 "balancedness_after": y.balancedness_after,
                 "max_rank_load_before_assignments": y.max_rank_load_before,
                 "max_rank_load_after_assignments": y.max_rank_load_after,
                 "window_balancedness_before": y.window_balancedness_before,
                 "window_balancedness_after": y.window_balancedness_after,
                 "holdout_balancedness_before": y.holdout_before,
                 "holdout_balancedness_after": y.holdout_after,
                 "rank_load_before_assignments": y.rank_load_before,
                 "rank_load_after_assignments": y.rank_load_after,
                 "replicated": [{"expert": le, "replicas": n} for le, n in y.replicated]}
                for y in e.layers
            ],
            "placement": placement_document(e.placement) if include_placement else None,
        }
    return {
        "schema": BALANCE_SCHEMA,
        "source": result.source,
        **partial_json(result.partial),
        "kind": result.kind,
        "model": result.model,
        "routing": result.routing,
        "num_experts": result.num_experts,
        "topk": result.topk,
        "execution": {"device": result.device, "torch_version": torch.__version__},
        "elapsed_s": result.elapsed_s,
        **_counted(result),
        "notes": result.notes,
        "world_size": result.world_size,
        "ranks": None if result.ranks is None else [
            {"rank": r.rank, "role": r.role, "assignments": r.assignments, "share": r.share, "imbalance": r.imbalance,
             "cv": r.cv, "hottest_expert": r.hottest, "tv_distance_from_global": r.tv_from_global}
            for r in result.ranks
        ],
        "capacity_factors": result.capacity_factors,
        "bias_effect_note": result.bias_note,
        "eplb_note": result.eplb_note,
        "all_layers": {**load_json(result.total_load, "assignments"), "expert_counts_assignments": result.total_counts,
                       "idle_layer_expert_pairs": idle_layer_expert_pairs(x.load for x in result.layers)},
        "ep": [
            {"placement": s.placement, "num_ranks": s.num_ranks,
             "balancedness_over_layers": _quantiles(s.balancedness),
             "step_balancedness_mean": s.step_balancedness_mean, "worst_layer": s.worst_layer}
            for s in result.ep
        ],
        "eplb": eplb,
        "layers": [_layer(x) for x in result.layers],
    }


# ---------------------------------------------------------------------------------------
# import
def render_import(imported: ImportedRouting | ImportedCounts, out: str | None, console: Console) -> None:
    """Print what an import read (and where it wrote the trace): the dump in a header panel,
    as the other commands show their inputs (a long path takes the terminal's width there,
    not a narrow table's), then the layers."""
    header = Table.grid(padding=(0, 2))
    header.add_row("input", user_text(f"{imported.source} ({imported.format})"))
    header.add_row("model", user_text(imported.model or "-"))
    console.print(Panel(header, title="routetool import", expand=False))
    t = table("Per layer", ["layer", "tokens", "steps", "weights"] if isinstance(imported, ImportedRouting)
              else ["layer", "steps", "assignments"])
    if isinstance(imported, ImportedRouting):
        for layer, x in list(imported.layers.items())[:_MAX_LAYER_ROWS]:
            t.add_row(str(layer), f"{x.num_tokens:,}", str(x.num_steps),
                      "logits" if x.gating_output is not None else "yes" if x.topk_weights is not None else "no")
    else:
        for layer, m in list(imported.layers.items())[:_MAX_LAYER_ROWS]:
            t.add_row(str(layer), str(m.shape[0]), f"{int(m.sum()):,}")
    console.print(t)
    summary = f"E={imported.num_experts} topk={imported.topk if imported.topk else '?'}, {len(imported.layers)} layer(s)"
    if isinstance(imported, ImportedRouting):
        summary += (f", {imported.num_tokens:,} token rows kept of {imported.rows_read:,} read")
    console.print(Text(summary))
    for note in imported.notes:
        console.print(user_text("• " + note, style="yellow"))
    if out:
        kind = "trace with logits" if isinstance(imported, ImportedRouting) and imported.has_logits else "ids-only trace"
        console.print(user_text(f"wrote {out} ({kind})", style="green"))


class BalanceReport:
    """balance's report (:class:`routetool.report.protocol.Report`): ``focus_layer`` shown in
    detail; its other faces are the EPLB placement (``--eplb-out``) and the PNG figures
    (``--plot``). Exit code 0: balance measures, it does not judge."""

    exit_code = EXIT_OK

    def __init__(self, result: BalanceResult, focus_layer: int | None = None) -> None:
        self.result = result
        self.focus_layer = focus_layer

    def terminal(self, console: Console, details: bool = False) -> None:
        render_balance(self.result, console, self.focus_layer, details=details)

    def document(self) -> dict:
        return balance_json(self.result)

    def placement(self) -> dict | None:
        """The EPLB placement as its JSON document (None without the EPLB what-if)."""
        result = self.result
        if result.eplb is None:
            return None
        return placement_document(result.eplb.placement, source=result.source, model=result.model,
                                  routing=result.routing, fitted_on_assignments=[x.assignments for x in result.layers])

    def plots(self, folder: str, force: bool = False) -> list:
        """Write the PNG figures into ``folder`` (:func:`routetool.report.plots.write_balance_plots`);
        returns their paths."""
        from routetool.report.plots import write_balance_plots

        return write_balance_plots(self.result, folder, force=force)
