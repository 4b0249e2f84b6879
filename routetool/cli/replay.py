"""``routetool replay``: check the paths, open the trace, run the replay, render, exit with its code."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from routetool.cli.common import KERNEL_SIGNATURE_HELP, _finite, _progress
from routetool.cli.numbers import INT, FloatRange
from routetool.cli.paths import PATH, PATH_TEXT
from routetool.engine.execution import DEVICE_CHOICES, kernel_source, kernel_stdout
from routetool.errors import RouteToolError
from routetool.report.tables import Console, markup_safe


@click.command()
@click.argument("trace", type=PATH)
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True,
              help="cuda: compiled kernels and latency; cpu: the Triton interpreter (no latency); auto: cuda if present.")
@click.option("--kernel", "kernel_spec", default="tiled", show_default=True,
              help="Kernel variant (tiled, seed) or module:function. " + KERNEL_SIGNATURE_HELP)
@click.option("--layers", "layers_spec", default="all", show_default=True,
              help="Layers to replay, e.g. 0,2,5-7.")
@click.option("--layer", "histogram_layer", type=INT, default=None,
              help="Show the expert-load histogram of this layer (default: all replayed layers summed).")
@click.option("--tie-ulps", type=FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=_finite,
              help="Near-tie tolerance in float32 ulps for the tie-equivalent class (0 = exact ties only).")
@click.option("--latency/--no-latency", default=True, show_default=True,
              help="Time each distinct step shape under CUDA graphs (GPU only).")
@click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH",
              help="Also write the results as JSON to PATH ('-' = stdout; the tables then go to stderr).")
@click.option("--details", "-v", "details", is_flag=True,
              help="Every table: per layer, every step shape, the expert-load chart (default: a one-screen summary).")
@click.option("--force", is_flag=True, help="Replace an existing --json file.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def replay(trace: Path, device: str, kernel_spec: str, layers_spec: str, histogram_layer: int | None,
           tie_ulps: float, latency: bool, json_path: str | None, details: bool, force: bool, progress: bool) -> None:
    """Replay TRACE (a trace file, an index, or a run folder of rank-<r>/ traces) through the
    routing kernel and the reference, and report.

    For every layer and captured step: classifies each token row (exact, reordered,
    tie-equivalent, mismatch, invalid), checks padding and weights, builds expert-load
    histograms, and on a GPU times each distinct step shape. Exit 1 on a real mismatch,
    invalid output or weight outside tolerance, or a kernel that fails (crashes, rejects the
    trace without documenting it); exit 2 when it rejects the trace as its docstring documents.

    A run folder is replayed rank by rank and summed, each rank's totals shown too. Under
    `torchrun --nproc-per-node N -m routetool replay ...` the ranks' layers are shared among
    the N processes (one GPU each where there are enough) and the first process reports.
    """
    from routetool.engine.distributed import join

    workers = join(device)  # under torchrun: the group first, so that every process ends with it
    from routetool.io.inputs import check_output_paths, require_input

    require_input(trace)  # usage errors before torch is imported
    check_output_paths([json_path], force=force, inputs=[trace, kernel_source(kernel_spec)])
    from routetool.analysis.replay import parse_layers, replay_trace
    from routetool.engine.execution import load_kernel, select_execution
    from routetool.io.inputs import open_input
    from routetool.report.formats import write_json
    from routetool.report.replay import render_replay, replay_json

    execution = select_execution(device)
    # a kernel's print() must not mix into the JSON on stdout
    with kernel_stdout(json_path == "-"):
        name, fn = load_kernel(kernel_spec)
        execution = execution.for_kernel(fn)  # a plain torch kernel on the CPU: no Triton interpreter
        with open_input(trace) as t:
            layers = parse_layers(layers_spec, t.layers, t.display_path)
            if histogram_layer is not None and histogram_layer not in layers:
                raise RouteToolError(f"--layer {histogram_layer} is not among the replayed layers",
                                     fix=f"choose among {', '.join(map(str, layers))}")
            with _progress(progress and workers.is_first) as bar:
                task = bar.add_task(markup_safe(f"replay {trace.name} ({name})"), total=t.num_tokens(layers))
                result = replay_trace(
                    t, name, fn, execution, layers=layers, tie_ulps=tie_ulps, measure_latency=latency,
                    progress=lambda n: bar.advance(task, n), workers=workers,
                )
    if workers.is_first:
        console = Console(stderr=json_path == "-")
        render_replay(result, console, histogram_layer, details=details)
        if json_path is not None:
            write_json(replay_json(result), json_path, sys.stdout)
    click.get_current_context().exit(result.verdict.exit_code)
