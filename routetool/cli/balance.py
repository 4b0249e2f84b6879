"""``routetool balance`` and ``routetool import`` (click commands; registered by routetool.cli).

Thin: parse options, build a source, call :func:`routetool.analysis.balance.analyze_balance` or the
importers; the command base (:mod:`routetool.cli.command`) checks the paths, renders the report and
writes its sinks (``--json``, ``--eplb-out``, ``--plot``). Bad input raises :class:`~routetool.errors.RouteToolError`, which
the ``routetool`` group turns into a one-line message and exit code 2; a faulty kernel under
test raises :class:`~routetool.errors.KernelError`, one line and exit code 1.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from routetool.cli.command import (
    HTML_PATH,
    Run,
    check_output_paths,
    details_option,
    device_option,
    force_option,
    json_option,
    kernel_option,
    output_option,
    progress_option,
    require_input,
    run_command,
)
from routetool.cli.paths import PATH
from routetool.errors import EXIT_OK, RouteToolError
from routetool.io.dump_options import DEFAULT_DROP_REPEATS, FORMATS, LOGITS_FORMATS, OPTIONS_READ, READING_OPTIONS
from routetool.numtext import list_items, parse_float, parse_int, refuse_repeats
from routetool.report.sinks import JsonSink, PlotSink, Sinks
from routetool.report.tables import Console, markup_safe

_CTX = {"help_option_names": ["-h", "--help"]}


def _int_list(option: str, spec: str | None) -> list[int] | None:
    if spec is None or spec.strip().lower() in ("", "auto"):
        return None
    values = [parse_int(v) for v in list_items(option, spec, f"{option} 8,16")]
    if any(v is None for v in values):
        raise RouteToolError(f"{option} {spec!r} is not a list of integers", fix=f"use e.g. {option} 8,16")
    if any(v < 1 for v in values):
        raise RouteToolError(f"{option} {spec!r}: values must be >= 1", fix=f"use e.g. {option} 8,16")
    return refuse_repeats(option, spec, values)


def _float_list(option: str, spec: str) -> list[float]:
    if spec.strip().lower() in ("", "none"):
        return []
    values = [parse_float(v) for v in list_items(option, spec, f"{option} 1.0,1.25,2")]
    if any(v is None for v in values):
        raise RouteToolError(f"{option} {spec!r} is not a list of numbers", fix=f"use e.g. {option} 1.0,1.25,2")
    if any(not v > 0 for v in values):
        raise RouteToolError(f"{option} {spec!r}: factors must be > 0", fix=f"use e.g. {option} 1.0,1.25,2")
    return refuse_repeats(option, spec, values)


def _stats_device(choice: str):
    """The torch device for statistics when no kernel runs (no Triton involved)."""
    import torch

    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise RouteToolError("--device cuda: torch sees no CUDA GPU", fix="use --device cpu")
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda and choice != "cpu" else torch.device("cpu")


def _import_options(fmt, num_experts, topk, skip_rows, drop_repeats, select, model=None, refuse_counts=None):
    from routetool.io.dumps import ImportOptions

    ctx = click.get_current_context()
    return ImportOptions(format=fmt, num_experts=num_experts, topk=topk, skip_rows=skip_rows,
                         drop_repeats=drop_repeats, select=select, model=model,
                         given=frozenset(name for name in READING_OPTIONS if _given(ctx, name)),
                         refuse_counts=refuse_counts)


def _dump_options(f):
    """Options shared by both commands for reading routing dumps."""
    for opt in reversed([
        click.option("--format", "fmt", type=click.Choice(FORMATS), default="auto", show_default=True,
                     metavar="FORMAT", help=f"Input format: {', '.join(FORMATS)} (auto: by extension and content)."),
        click.option("--num-experts", type=click.IntRange(min=1), default=None,
                     help="Routed experts E of a dump (default: the file's metadata, else largest id + 1)."),
        click.option("--topk", type=click.IntRange(min=1), default=None,
                     help="Experts per token K of a dump (default: metadata, else the row width)."),
        click.option("--skip-rows", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Drop the first N token rows of a dump (warm-up)."),
        click.option("--drop-repeats", type=click.IntRange(min=0), default=DEFAULT_DROP_REPEATS, show_default=True,
                     help="Drop runs of at least N identical consecutive rows of a dump (warm-up/dummy batches); "
                          "0 keeps everything."),
        click.option("--select", default=None, metavar="NAME[/NAME]",
                     help="Counts JSON: the tables to use, e.g. olmoe-1b-7b-0924 or olmoe-1b-7b-0924/arxiv."),
    ]):
        f = opt(f)
    return f


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the user gave option ``name`` (not its default)."""
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT,
                                                  click.core.ParameterSource.DEFAULT_MAP)


def _balance_command(source: Path) -> str:
    """``routetool balance SOURCE`` for a dump of per-expert counts, with the options for reading
    one that the user gave this command (``--select`` above all: a counts file with several
    models needs it; those that only dumps of token rows read are left out), quoted for a shell."""
    ctx = click.get_current_context()
    parts = ["routetool", "balance", shlex.quote(str(source))]
    for name, flag in {"fmt": "--format", **READING_OPTIONS}.items():
        if _given(ctx, name) and (name == "fmt" or name in OPTIONS_READ["counts-json"]):
            parts += [flag, shlex.quote(str(ctx.params[name]))]
    return " ".join(parts)


def _reject_dump_options(source: Path) -> None:
    """A trace records E, K and its steps: the options for reading dumps do not apply to it."""
    ctx = click.get_current_context()
    given = [flag for name, flag in READING_OPTIONS.items() if _given(ctx, name)]
    if given:
        raise RouteToolError(f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} to routing dumps, not to a "
                             "trace (a trace records its num_experts, topk and steps)", path=source,
                             fix=f"drop {', '.join(given)}")


def _check_figures_apart(figures: list[Path], outputs: dict[str, str | None], inputs: list) -> None:
    """No --plot figure may be another output of the run or one of its inputs."""
    from routetool.io.paths import resolved

    for fig in figures:
        for flag, out in outputs.items():
            if out is not None and out != "-" and resolved(fig) == resolved(out):
                raise RouteToolError(f"is named by {flag} and is a --plot figure", path=fig,
                                     fix="give each output its own file")
        for inp in inputs:
            if inp is not None and resolved(fig) == resolved(inp):
                raise RouteToolError("is this run's input; a --plot figure would replace it", path=fig,
                                     fix="choose another --plot folder")


@click.command("balance", context_settings=_CTX)
@click.argument("source", type=PATH)
@device_option("Where routing and statistics run (auto: cuda if present).")
@kernel_option("Kernel that routes a trace's logits (variant or module:function); without a GPU the reference routes "
               "them unless --kernel is given. Given explicitly, every layer needs logits. Excludes --reference and "
               "--recorded.", show_default="tiled on a GPU; without one the reference")
@click.option("--reference", is_flag=True, help="Route a trace's logits with the PyTorch reference instead of a kernel.")
@click.option("--recorded", is_flag=True, help="Use the trace's recorded topk_ids instead of routing the logits.")
@click.option("--layers", "layers_spec", default="all", show_default=True, help="Layers, e.g. 0,2,5-7.")
@click.option("--layer", "focus_layer", type=int, default=None,
              help="Also show layer L (one of --layers) in detail: its windows, EPLB placement per GPU, expert and "
                   "rank bars, its row in bold; every table still covers all of --layers.")
@click.option("--ep-size", "ep_spec", default=None, metavar="N[,N...]",
              help="EP sizes to simulate with contiguous placement (default: the largest of 8, 4, 2, 1 dividing E).")
@click.option("--placement", "placement_path", type=PATH, default=None,
              help="Also simulate this placement JSON (e.g. one written by --eplb-out).")
@click.option("--windows", type=click.IntRange(min=1), default=8, show_default=True,
              help="At most this many windows of consecutive steps (cut by rows; empty ones dropped) for drift over time.")
@click.option("--decode-max-tokens", type=click.IntRange(min=0), default=256, show_default=True,
              help="Steps with padding or at most this many tokens count as decode, the rest as prefill.")
@click.option("--capacity-factor", "capacity_spec", default="1.0,1.25,2.0", show_default=True,
              help="Capacity factors to evaluate ('none' to skip).")
@click.option("--top", "top_n", type=click.IntRange(min=1), default=5, show_default=True,
              help="Hottest experts listed.")
@click.option("--eplb/--no-eplb", default=True, show_default=True, help="EPLB what-if (replication and placement).")
@click.option("--redundant", type=click.IntRange(min=0), default=None,
              help="EPLB redundant experts (default: one per GPU).")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="EPLB GPUs (default: the first --ep-size).")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="EPLB nodes.")
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True,
              help="EPLB expert groups (DeepSeek-V3: 8).")
@click.option("--eplb-policy", type=click.Choice(("auto", "hierarchical", "global")), default="auto",
              show_default=True, help="auto: hierarchical when nodes > 1 divide the groups, else global.")
@output_option("--eplb-out", "eplb_out", "Write the EPLB placement as JSON.")
@click.option("--bias-effect/--no-bias-effect", default=True, show_default=True,
              help="Route again with the bias zeroed (traces with logits only).")
@json_option("Also write the results as JSON to PATH ('-' = stdout; the tables then go to stderr).")
@click.option("--plot", "plot_dir", default=None, metavar="DIR", help="Write PNG figures into DIR (needs matplotlib).")
@details_option("Every layer's tables and the charts (default: a one-screen summary with the worst layers).")
@force_option("Replace existing --json/--eplb-out/--plot/--html outputs.")
@progress_option()
@_dump_options
def balance(source: Path, fmt: str, num_experts, topk, skip_rows, drop_repeats, select, device: str, kernel_spec: str,
            reference: bool, recorded: bool, layers_spec: str, focus_layer: int | None, ep_spec: str | None,
            placement_path: Path | None, windows: int, decode_max_tokens: int, capacity_spec: str, top_n: int,
            eplb: bool, redundant, gpus, nodes: int, groups: int, eplb_policy: str, eplb_out: str | None,
            bias_effect: bool, json_path: str | None, plot_dir: str | None, details: bool, force: bool,
            progress: bool) -> None:
    """Load balance of SOURCE over experts and expert-parallel ranks, and what EPLB would buy.

    SOURCE is a routetool trace, or a routing dump read directly: JSON lines, CSV (or a
    folder of them), SGLang expert-distribution .pt dumps, per-layer expert counts as JSON,
    and what engines emit: vLLM and SGLang routed experts, Megatron RouterReplay .pt and
    expert-load .npz dumps, FlashInfer-Trace MoE workloads (logits, routed as a trace).
    Reports per layer: tokens per expert (max/mean, CV, entropy, Gini, idle, hottest),
    balancedness per EP size (whole layer and per step), an EPLB placement and the
    balancedness before/after, the router bias effect, capacity overflow, and drift
    between prefill and decode and over time.
    """
    kernel_given = _given(click.get_current_context(), "kernel_spec")

    def usage() -> None:
        if reference and recorded:
            raise RouteToolError("--reference and --recorded exclude each other", fix="pass one of them")
        if kernel_given and reference:
            raise RouteToolError("--kernel and --reference exclude each other: each chooses what routes the logits",
                                 fix="pass one of them")
        if kernel_given and recorded:
            raise RouteToolError("--kernel and --recorded exclude each other: --recorded takes the trace's topk_ids, "
                                 "and the reference routes its bias effect", fix="pass one of them")

    def analyse(run: Run):
        if eplb_out and not eplb:
            raise RouteToolError("--eplb-out needs the EPLB what-if", fix="drop --no-eplb")
        if plot_dir is not None:
            from routetool.io.inputs import refuse_rank_folder
            from routetool.io.inputs import rank_folders
            from routetool.report.plots import check_plot_dir, figure_paths

            refuse_rank_folder(plot_dir, rank_folders(source))
            check_plot_dir(plot_dir, force)
            _check_figures_apart(figure_paths(plot_dir), {"--json": json_path, "--eplb-out": eplb_out,
                                                          "--html": click.get_current_context().meta.get(HTML_PATH)},
                                 [source, placement_path])
        capacity = _float_list("--capacity-factor", capacity_spec)
        ep_sizes = _int_list("--ep-size", ep_spec)
        from routetool.analysis.balance import (  # after the usage checks: these import torch
            BalanceOptions, CountsSource, EplbOptions, ImportedSource, RunSource, TraceSource, analyze_balance,
            default_ep_sizes, route_fn_from,
        )
        from routetool.engine.stream import DEFAULT_CHUNK_BYTES
        from routetool.analysis.eplb import load_placement
        from routetool.io.dumps import ImportedCounts, read_dump, resolve_format
        from routetool.analysis.replay import parse_layers
        from routetool.report.balance import BalanceReport

        resolved_format = resolve_format(source, fmt)
        if resolved_format == "trace":
            _reject_dump_options(source)
        import tempfile
        from contextlib import ExitStack

        cleanup = ExitStack()
        trace_path = source
        if resolved_format in LOGITS_FORMATS:  # a dump of logits: routed as a trace, written to a temporary file
            from routetool.io.dumps import write_imported_trace

            imported = read_dump(source, _import_options(resolved_format, num_experts, topk, skip_rows, drop_repeats,
                                                         select))
            with ExitStack() as pending:
                folder = pending.enter_context(tempfile.TemporaryDirectory(prefix="routetool-"))
                trace_path = Path(folder) / "dump.safetensors"
                write_imported_trace(imported, trace_path)
                cleanup.push(pending.pop_all())  # removed when the analysis ends
            resolved_format = "trace"
        if resolved_format != "trace" and (reference or recorded or kernel_given):
            flag = "--kernel" if kernel_given else "--reference/--recorded"
            raise RouteToolError(f"{flag} {'applies' if kernel_given else 'apply'} to traces; a dump holds ids already",
                                 path=source, fix=f"drop {flag if kernel_given else 'the flag'}")

        trace = None
        with cleanup:
            try:
                if resolved_format == "trace":
                    from routetool.io.inputs import open_input

                    # a trace file, a sharded trace's index, a run folder, or a dump of logits written as a trace
                    trace = open_input(trace_path, display_path=source)
                    layers = parse_layers(layers_spec, trace.layers, trace.display_path)
                    logits = [r.trace.info(x).has_logits for r in trace.ranks for x in layers if x in r.trace.layers]
                    needs_logits = not recorded and any(logits)
                    bias_wanted = bias_effect and any(logits)
                    route_fn = nobias_fn = None
                    route_name = nobias_name = ""
                    reference_by_default = False
                    if needs_logits or bias_wanted:
                        from routetool.engine.execution import load_kernel, select_execution, uses_triton

                        execution = select_execution(device)
                        stats_device = execution.device
                        from routetool_kernels.reference import musespark1x_routing_reference

                        # a load question on a machine without a GPU: the reference gives the routing the
                        # kernel must give, at a fraction of the cost of the kernel under the Triton interpreter
                        reference_by_default = not (reference or recorded or kernel_given) and execution.interpreted
                        if reference or recorded or reference_by_default:
                            route_name = "reference (PyTorch" + (", the default without a GPU)" if reference_by_default
                                                                 else ")")
                            route_fn = route_fn_from(musespark1x_routing_reference, trace.meta.router, name=route_name)
                        else:
                            name, fn = load_kernel(kernel_spec)
                            where = (("Triton interpreter" if uses_triton(fn) else "CPU") if execution.interpreted
                                     else execution.device_name)
                            route_name = f"kernel {name} ({where})"
                            route_fn = route_fn_from(fn, trace.meta.router, kernel=True, name=route_name)
                        if bias_wanted:
                            nobias_fn, nobias_name = route_fn, route_name
                    else:
                        stats_device = _stats_device(device)
                    # an explicit --kernel, like --reference, routes every layer (an ids-only layer is refused)
                    routing = ("recorded" if recorded else "reference" if reference else "kernel" if kernel_given
                               else "auto")

                    def rank_source(t, rank_layers, budget_bytes=DEFAULT_CHUNK_BYTES):
                        return TraceSource(t, rank_layers, routing=routing, route_fn=route_fn, route_name=route_name,
                                           nobias_fn=nobias_fn, nobias_name=nobias_name, bias_effect=bias_effect,
                                           decode_max_tokens=decode_max_tokens, budget_bytes=budget_bytes)

                    if trace.is_run:
                        src = RunSource(trace, layers, rank_source)
                        total_work = sum(sum(src.step_sizes(x)) for x in layers)
                    else:
                        src = rank_source(trace.ranks[0].trace, layers)
                        total_work = trace.num_tokens(layers)
                else:
                    stats_device = _stats_device(device)
                    imported = read_dump(source, _import_options(resolved_format, num_experts, topk, skip_rows,
                                                                 drop_repeats, select))
                    layers = parse_layers(layers_spec, sorted(imported.layers), source)
                    if isinstance(imported, ImportedCounts):
                        src = CountsSource(imported, layers)
                        total_work = sum(int(imported.layers[x].sum()) for x in layers)
                    else:
                        src = ImportedSource(imported, layers, decode_max_tokens=decode_max_tokens)
                        total_work = sum(imported.layers[x].num_tokens for x in layers)
                if focus_layer is not None and focus_layer not in layers:
                    raise RouteToolError(f"--layer {focus_layer} is not among the analysed layers",
                                         fix=f"choose among {', '.join(map(str, layers[:20]))}")
                E = src.num_experts
                if ep_sizes is None:
                    ep_sizes = default_ep_sizes(E)
                placement = None
                if placement_path is not None:
                    placement = load_placement(placement_path, E, layers, ep_sizes[0] if ep_spec else None)
                options = BalanceOptions(
                    ep_sizes=ep_sizes, placement=placement, windows=windows, capacity_factors=capacity, top_n=top_n,
                    eplb=EplbOptions(num_redundant=redundant, num_gpus=gpus, num_nodes=nodes, num_groups=groups,
                                     policy=eplb_policy) if eplb else None,
                )
                with run.progress() as bar:
                    task = bar.add_task(markup_safe(f"balance {source.name}"), total=total_work)
                    result = analyze_balance(src, options, stats_device, progress=lambda n: bar.advance(task, n),
                                             workers=run.workers)
            finally:
                if trace is not None:
                    trace.close()
        if trace is not None and reference_by_default:
            result.notes.append("routed by the PyTorch reference, the default without a GPU: the routing the kernel "
                                "must give, at a fraction of the Triton interpreter's cost "
                                f"(--kernel {kernel_spec}: the kernel)")
        return BalanceReport(result, focus_layer)

    # every output is checked before any work: never one file twice, never an input
    sinks = Sinks(JsonSink(json_path, announce=True), JsonSink(eplb_out, flag="--eplb-out", announce=True,
                                                               document=lambda report: report.placement()),
                  PlotSink(plot_dir, force=force))
    run_command(analyse, sinks=sinks, device=device, inputs=[source], input_what="file or folder",
                reads=[placement_path], kernels=[kernel_spec], force=force, progress=progress, details=details,
                usage=usage)


@click.command("import", context_settings=_CTX)
@click.argument("source", type=PATH)
@click.option("-o", "--output", "output", required=True, type=PATH,
              help="The trace to write (.safetensors): ids only, or with logits from a FlashInfer-Trace workload.")
@_dump_options
@click.option("--model", default=None, help="Model name to record (default: from the file, else its name).")
@force_option("Replace an existing output.")
def import_(source: Path, output: Path, fmt: str, num_experts, topk, skip_rows, drop_repeats, select,
            model: str | None, force: bool) -> None:
    """Convert a routing dump (JSON lines, CSV or a folder of CSVs, SGLang per-token .pt,
    vLLM or SGLang routed experts, Megatron RouterReplay .pt) into an ids-only routetool trace,
    or a FlashInfer-Trace MoE workload into a trace with logits, for `routetool balance`,
    `replay` and any tool reading traces.

    Per-expert counts (counts JSON, SGLang stat/per-pass dumps, Megatron expert-load .npz)
    have no per-token ids and cannot become a trace: analyse them directly with
    `routetool balance FILE`.
    """
    require_input(source, what="file or folder")  # usage errors before torch is imported
    # before any work: '-' is refused (a trace is a file), and the dump is never the output
    check_output_paths([output], force=force, inputs=[source], allow_stdout=False)
    from routetool.io.dumps import read_dump, write_imported_trace
    from routetool.report.balance import render_import

    # a dump of per-expert counts is refused as soon as it is recognised, before --select and the like apply
    imported = read_dump(source, _import_options(fmt, num_experts, topk, skip_rows, drop_repeats, select, model,
                                                 refuse_counts=f"analyse it directly: {_balance_command(source)}"))
    write_imported_trace(imported, output, force=force)
    render_import(imported, str(output), Console())
    click.get_current_context().exit(EXIT_OK)
