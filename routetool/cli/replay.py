"""``routetool replay``: its options and its analysis step (open the trace, replay it through the
kernel); the command base (routetool.cli.command) checks the paths, renders and exits."""

from __future__ import annotations

from pathlib import Path

import click

from routetool.cli.command import (
    Run, details_option, device_option, finite, force_option, json_option, kernel_option, progress_option, run_command
)
from routetool.cli.paths import PATH
from routetool.errors import RouteToolError
from routetool.report.sinks import JsonSink, Sinks
from routetool.report.tables import markup_safe


@click.command()
@click.argument("trace", type=PATH)
@device_option("cuda: compiled kernels and latency; cpu: the Triton interpreter (no latency); auto: cuda if present.")
@kernel_option("Kernel variant (tiled, seed) or module:function.")
@click.option("--layers", "layers_spec", default="all", show_default=True,
              help="Layers to replay, e.g. 0,2,5-7.")
@click.option("--layer", "histogram_layer", type=int, default=None,
              help="Show the expert-load histogram of this layer (default: all replayed layers summed).")
@click.option("--tie-ulps", type=click.FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=finite,
              help="Near-tie tolerance in float32 ulps for the tie-equivalent class (0 = exact ties only).")
@click.option("--latency/--no-latency", default=True, show_default=True,
              help="Time each distinct step shape under CUDA graphs (GPU only).")
@json_option("Also write the results as JSON to PATH ('-' = stdout; the tables then go to stderr).")
@details_option("Every table: per layer, every step shape, the expert-load chart (default: a one-screen summary).")
@force_option("Replace an existing --json file.")
@progress_option()
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

    def analyse(run: Run):
        from routetool.analysis.replay import parse_layers, replay_trace
        from routetool.engine.execution import load_kernel, select_execution
        from routetool.io.inputs import open_input
        from routetool.report.replay import ReplayReport

        execution = select_execution(device)
        name, fn = load_kernel(kernel_spec)
        execution = execution.for_kernel(fn)  # a plain torch kernel on the CPU: no Triton interpreter
        with open_input(trace) as t:
            layers = parse_layers(layers_spec, t.layers, t.display_path)
            if histogram_layer is not None and histogram_layer not in layers:
                raise RouteToolError(f"--layer {histogram_layer} is not among the replayed layers",
                                     fix=f"choose among {', '.join(map(str, layers))}")
            with run.progress() as bar:
                task = bar.add_task(markup_safe(f"replay {trace.name} ({name})"), total=t.num_tokens(layers))
                result = replay_trace(
                    t, name, fn, execution, layers=layers, tie_ulps=tie_ulps, measure_latency=latency,
                    progress=lambda n: bar.advance(task, n), workers=run.workers,
                )
        return ReplayReport(result, histogram_layer)

    run_command(analyse, sinks=Sinks(JsonSink(json_path)), device=device, inputs=[trace], kernels=[kernel_spec],
                force=force, progress=progress, details=details)
