"""Reporters of the capture commands: ``routetool info``, ``synth`` and ``capture hf``.

Result dataclasses in, rich tables and JSON documents out; nothing here computes results.
"""

from __future__ import annotations

import shlex

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from routetool.io.info import TraceInfo, step_token_quantiles
from routetool.io.limits import fmt_bytes
from routetool.numtext import parse_int
from routetool.report.tables import fmt_float, layer_list, router_line, table, user_text

INFO_SCHEMA = "routetool.info/1"


def _number_text(value: str) -> str:
    """A metadata value that is a whole number written as every report writes counts
    (``16384`` -> ``16,384``); any other text as it is."""
    n = parse_int(value)
    return f"{n:,}" if n is not None and str(n) == value else value


# ---------------------------------------------------------------------------------------
# routetool info
def render_info(info: TraceInfo, console: Console, max_shapes: int = 12) -> None:
    """Print ``routetool info``: header, per-layer table, tensors, step shapes, notes."""
    header = Table.grid(padding=(0, 2))
    header.add_row("trace", user_text(info.trace))
    if info.sharded:
        idx = info.index or {}
        state = "complete" if idx.get("complete") else "INCOMPLETE"
        last = idx.get("last_complete_step")
        header.add_row("layout", f"sharded: {idx.get('num_shards')} shards + index, {state} "
                                 f"(stopped by: {idx.get('stopped_by') or 'unknown: still recording or killed'}"
                                 + (f"; last complete step: {last}" if last is not None else "") + ")")
    else:
        header.add_row("layout", "one file")
    header.add_row("size", f"{fmt_bytes(info.size_bytes)} ({info.size_bytes:,} bytes)")
    header.add_row("format", f"routetool-trace v{info.format_version}")
    header.add_row("model", user_text(info.model or "-"))
    unknown = info.metadata.get("router_parameters")
    header.add_row("router", router_line(info.router, unknown))  # (an ids-only import: only E and topk are real)
    for key in sorted(info.metadata):
        if key == "router_parameters" and unknown is not None:
            continue  # (said on the router line)
        header.add_row(user_text(key), user_text(_number_text(info.metadata[key])))
    header.add_row("provenance", user_text(info.provenance or "-"))
    header.add_row("layers", f"{len(info.layers)}: {', '.join(str(x.layer) for x in info.layers)}")
    header.add_row("rows", f"{info.total_tokens:,} (tokens x layers) in {info.total_steps:,} layer-steps")
    header.add_row("recorded outputs", {"all": "topk_ids/topk_weights in every layer", "some": "in some layers",
                                        "none": "none (inputs only)"}[info.recorded_outputs])
    if info.scanned:
        header.add_row("padded rows", f"{info.padded_rows:,} ({fmt_float(100 * info.padded_fraction)}%)")
        header.add_row("non-finite rows", f"{info.nonfinite_rows:,}")
    console.print(Panel(header, title="routetool info", expand=False))

    columns = ["layer", "rows", "steps", "rows/step min", "p50", "max", "max|bias|", "recorded"]
    if info.scanned:
        columns += ["padded", "nonfinite"]
    tbl = table("Per layer", columns, left=("recorded",))
    for layer in info.layers:
        q = step_token_quantiles(layer.step_tokens)
        recorded = "ids+weights" if layer.has_recorded_weights else ("ids" if layer.has_recorded_ids else "-")
        row = [
            str(layer.layer), f"{layer.num_tokens:,}", f"{layer.num_steps:,}",
            *((f"{q[0]:,}", fmt_float(q[1]), f"{q[2]:,}") if q else ("-", "-", "-")),
            fmt_float(layer.bias_abs_max) if layer.has_bias else "zeros", recorded,
        ]
        if info.scanned:
            frac = layer.padded_fraction or 0.0
            row += [f"{layer.padded_rows:,} ({fmt_float(100 * frac)}%)",
                    Text(f"{layer.nonfinite_rows:,}", style="yellow" if layer.nonfinite_rows else "dim")]
        tbl.add_row(*row)
    console.print(tbl)

    # tensors: one block per group of layers with the same tensors (usually all layers)
    groups: dict[tuple, list[int]] = {}
    for layer in info.layers:
        sig = tuple((name, t.dtype, t.shape) for name, t in layer.tensors.items())
        groups.setdefault(sig, []).append(layer.layer)
    tt = table("Tensors per layer", ["layers", "tensor", "dtype", "shape"], left=("layers", "tensor", "dtype"))
    for sig, members in groups.items():
        label = "all" if len(groups) == 1 else layer_list(members)
        for i, (name, dtype, shape) in enumerate(sig):
            tt.add_row(label if i == 0 else "", name, dtype, f"[{', '.join(f'{d:,}' for d in shape)}]")
    console.print(tt)

    shapes = info.step_shapes
    if shapes:
        unit = "steps" if info.steps_same_in_all_layers else "layer-steps"
        same = ", same in every layer" if info.steps_same_in_all_layers else ""
        title = f"Step shapes ({len(shapes)} distinct{same})"
        st = table(title, ["rows/step", unit])
        common = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))[:max_shapes]
        for rows, count in sorted(common):
            st.add_row(f"{rows:,}", f"{count:,}")
        if len(shapes) > max_shapes:
            st.caption = f"{max_shapes} most frequent of {len(shapes)}; --json lists all"
        console.print(st)
    for f in info.files if info.sharded else []:
        console.print(user_text(f"  {f.role:5} {f.path}  {fmt_bytes(f.size_bytes)}", style="dim"))
    if not info.scanned:
        console.print(Text("Header only: padded and non-finite rows are not counted (add --scan to read the data).",
                           style="dim"))


def render_run_info(run, infos: list[TraceInfo], console: Console) -> None:
    """Print ``routetool info`` of a run folder: the run, its router, and one row per rank
    (``routetool info RUN/rank-<r>/...`` shows a rank in full)."""
    first = infos[0]
    header = Table.grid(padding=(0, 2))
    header.add_row("run", user_text(str(run.display_path)))
    worlds = {r.layout.get("world_size") for r in run.ranks} - {None}
    header.add_row("ranks", f"{len(run.ranks)}" + (f" of a run of {worlds.pop()}" if len(worlds) == 1 else "")
                            + f", size {fmt_bytes(sum(i.size_bytes for i in infos))}")
    header.add_row("model", user_text(first.model or "-"))
    header.add_row("router", router_line(first.router, first.metadata.get("router_parameters")))
    header.add_row("rows", f"{sum(i.total_tokens for i in infos):,} (tokens x layers) in "
                           f"{sum(i.total_steps for i in infos):,} layer-steps, all ranks")
    console.print(Panel(header, title="routetool info", expand=False))
    columns = ["rank", "role", "layout", "layers", "steps", "rows", "size", "recorded"]
    if first.scanned:
        columns += ["padded", "nonfinite"]
    tbl = table("Per rank", columns, left=("rank", "role", "layout", "recorded"))
    for r, i in zip(run.ranks, infos):
        idx = i.index or {}
        layout = (f"{idx.get('num_shards')} shards" + ("" if idx.get("complete") else ", INCOMPLETE")) if i.sharded \
            else "one file"
        steps = {x.num_steps for x in i.layers}
        row = [r.label, r.role or "-", layout, f"{len(i.layers)}", f"{steps.pop():,}" if len(steps) == 1 else "varies",
               f"{i.total_tokens:,}", fmt_bytes(i.size_bytes), i.recorded_outputs]
        if first.scanned:
            row += [f"{i.padded_rows:,}", f"{i.nonfinite_rows:,}"]
        tbl.add_row(*row)
    console.print(tbl)
    for note in run.notes:
        console.print(user_text(f"note: {note}", style="yellow"))
    console.print(user_text(f"Each rank in full: routetool info {shlex.quote(str(run.ranks[0].trace.display_path))} "
                            "(and the other ranks' traces)", style="dim"))


def run_info_json(run, infos: list[TraceInfo]) -> dict:
    """The ``routetool info --json`` document of a run folder: the run and each rank's document."""
    return {"schema": INFO_SCHEMA, "run": str(run.display_path), "notes": run.notes,
            "ranks": [{"rank": r.rank, "layout": r.layout, **info_json(i)} for r, i in zip(run.ranks, infos)]}


def info_json(info: TraceInfo) -> dict:
    """The ``routetool info --json`` document (schema ``routetool.info/1``, docs/capture.md)."""
    return {
        "schema": INFO_SCHEMA,
        "trace": info.trace,
        "sharded": info.sharded,
        "index": info.index,
        "files": [{"path": f.path, "role": f.role, "size_bytes": f.size_bytes} for f in info.files],
        "size_bytes": info.size_bytes,
        "format_version": info.format_version,
        "model": info.model,
        "provenance": info.provenance,
        "router": info.router.document(),
        "metadata": dict(info.metadata),
        "scanned": info.scanned,
        "num_layers": len(info.layers),
        "total_tokens": info.total_tokens,
        "recorded_outputs": info.recorded_outputs,
        "padded_rows": info.padded_rows,
        "padded_fraction": info.padded_fraction,
        "nonfinite_rows": info.nonfinite_rows,
        "step_shapes": [{"num_tokens": rows, "steps": count} for rows, count in info.step_shapes.items()],
        "step_shapes_counted_per_layer": info.steps_same_in_all_layers,
        "layers": [
            {
                "layer": layer.layer,
                "num_tokens": layer.num_tokens,
                "num_steps": layer.num_steps,
                "step_tokens": layer.step_tokens,
                "tensors": {name: {"shape": list(t.shape), "dtype": t.dtype} for name, t in layer.tensors.items()},
                "has_bias": layer.has_bias,
                "bias_abs_max": layer.bias_abs_max,
                "has_padding": layer.has_padding,
                "has_recorded_ids": layer.has_recorded_ids,
                "has_recorded_weights": layer.has_recorded_weights,
                "padded_rows": layer.padded_rows,
                "padded_fraction": layer.padded_fraction,
                "nonfinite_rows": layer.nonfinite_rows,
                "nonfinite_padded_rows": layer.nonfinite_padded_rows,
            }
            for layer in info.layers
        ],
    }



class InfoReport:
    """info's report (:class:`routetool.report.protocol.Report`) of a trace or a run folder
    (``run``, from :func:`routetool.io.run.open_input`), ``infos`` one per rank; ``partial`` the
    run's partial steps, said first. Exit code 0."""

    exit_code = 0

    def __init__(self, run, infos: list[TraceInfo], partial) -> None:
        self.run = run
        self.infos = infos
        self.partial = partial

    def terminal(self, console: Console, details: bool = False) -> None:
        from routetool.report.partial import render_partial

        render_partial(self.partial, console)
        if self.run.is_run:
            render_run_info(self.run, self.infos, console)
        else:
            render_info(self.infos[0], console)

    def document(self) -> dict:
        from routetool.report.partial import partial_json

        doc = run_info_json(self.run, self.infos) if self.run.is_run else info_json(self.infos[0])
        return {"schema": doc.pop("schema"), **partial_json(self.partial), **doc}


# ---------------------------------------------------------------------------------------
# routetool synth
def render_synth(path: str, stats: list, console: Console) -> None:
    """Print the realised statistics of a synthetic trace (:class:`routetool.capture.synth.SynthLayerStats`):
    one table of rows and special rows, one of the load (two, so that each fits 80 columns)."""
    rows = table(user_text(f"{path}: realised statistics per layer"),
                 ["layer", "rows", "steps", "padded", "nonfinite", "ties@k"])
    for st in stats:
        rows.add_row(str(st.layer), f"{st.num_tokens:,}", str(st.num_steps), f"{st.padded_rows:,}",
                     f"{st.nonfinite_rows:,}", f"{st.boundary_ties:,}")
    rows.caption = "ties@k: unpadded rows with an exact tie at the k-th boundary"
    console.print(rows)

    targets = any(st.imbalance_target is not None for st in stats)
    columns = ["layer", "imb0", "imb", "CV", "idle", "max|bias|"]
    if targets:
        columns[1:1] = ["target", "affinity"]
    load = table("Load per layer (padded rows excluded)", columns)
    for st in stats:
        row = [str(st.layer), fmt_float(st.imbalance_zero_bias), fmt_float(st.imbalance), fmt_float(st.cv),
               str(st.idle_experts), fmt_float(st.bias_abs_max)]
        if targets:
            target = Text("-") if st.imbalance_target is None else Text(fmt_float(st.imbalance_target))
            if st.imbalance_target is not None and not st.target_reached:
                target = Text(f"{fmt_float(st.imbalance_target)} (!)", style="yellow")
            row[1:1] = [target, "-" if st.affinity is None else fmt_float(st.affinity)]
        load.add_row(*row)
    caption = ("imb0 / imb: max/mean tokens per expert without / with the bias; CV: std/mean with the bias; "
               "idle: experts no token picks")
    if targets:
        caption += ("; target: the layer's imbalance target, met on 2,048 calibration tokens (imb0 differs by "
                    "sampling noise, more for fewer tokens; (!): out of the model's reach, see the warning); "
                    "affinity: token-expert affinity of the logit model")
    load.caption = caption
    console.print(load)


# ---------------------------------------------------------------------------------------
# routetool capture hf
def render_hf_capture(summary, console: Console) -> None:
    """Print what ``routetool capture hf`` recorded (:class:`routetool.capture.hf.HFCapture`)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_row("trace", user_text(summary.out))
    grid.add_row("model", user_text(summary.model_name))
    grid.add_row("family", f"{summary.family} (router modules in layers {', '.join(map(str, summary.layers))})")
    grid.add_row("router", router_line(summary.router))
    grid.add_row("weights", f"{summary.weights_semantics} (recorded topk_weights)")
    grid.add_row("input", f"{summary.batch} x {summary.prompt_tokens} tokens ({summary.tokenizer}), "
                          f"{summary.max_new_tokens} new tokens")
    grid.add_row("steps", f"{summary.num_steps} per layer (1 prefill + {max(summary.num_steps - 1, 0)} decode), "
                          f"{summary.tokens_per_layer:,} rows per layer")
    console.print(Panel(grid, title="routetool capture hf", expand=False))
