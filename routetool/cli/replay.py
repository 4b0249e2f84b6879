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
from routetool.report.sinks import JsonSink, Sink, Sinks
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
@click.option("--save-routing", "routing_path", type=PATH, default=None,
              help="Also write the kernel's routing (topk_ids, topk_weights per layer) as an ids-only trace to PATH "
                   "(a new folder of rank-<r>/ traces for a run folder), for routetool diff.")
@json_option("Also write the results as JSON to PATH ('-' = stdout; the tables then go to stderr).")
@details_option("Every table: per layer, every step shape, the expert-load chart (default: a one-screen summary).")
@force_option("Replace an existing --json, --html or --save-routing file.")
@progress_option()
def replay(trace: Path, device: str, kernel_spec: str, layers_spec: str, histogram_layer: int | None,
           tie_ulps: float, latency: bool, routing_path: Path | None, json_path: str | None, details: bool,
           force: bool, progress: bool) -> None:
    """Replay TRACE (a trace file, an index, or a run folder of rank-<r>/ traces) through the
    routing kernel and the reference, and report.

    For every layer and captured step: classifies each token row (exact, reordered,
    tie-equivalent, mismatch, invalid), checks padding and weights, builds expert-load
    histograms, and on a GPU times each distinct step shape. Exit 1 on a real mismatch,
    invalid output or weight outside tolerance, or a kernel that fails (crashes, rejects the
    trace without documenting it); exit 2 when it rejects the trace as its docstring documents.

    With --save-routing, the kernel's outputs are written as a trace (a run folder for a run folder),
    which `routetool diff` compares with another kernel's, machine's or engine's routing.

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
            if routing_path is not None and not any(r.trace.info(x).has_logits for r in t.ranks for x in layers
                                                    if x in r.trace.layers):
                raise RouteToolError("holds no logits in the replayed layers: there is no kernel routing to save",
                                     path=trace, fix="leave out --save-routing: its recorded ids are a routing already, "
                                                     "which routetool diff reads")
            if histogram_layer is not None and histogram_layer not in layers:
                raise RouteToolError(f"--layer {histogram_layer} is not among the replayed layers",
                                     fix=f"choose among {', '.join(map(str, layers))}")
            with run.progress() as bar:
                task = bar.add_task(markup_safe(f"replay {trace.name} ({name})"), total=t.num_tokens(layers))
                result = replay_trace(
                    t, name, fn, execution, layers=layers, tie_ulps=tie_ulps, measure_latency=latency,
                    progress=lambda n: bar.advance(task, n), workers=run.workers, keep_routing=routing_path is not None,
                )
        return ReplayReport(result, histogram_layer)

    from routetool.io.run import is_run_folder

    routing = RoutingSink(None if routing_path is None else str(routing_path), force=force,
                          run_folder=routing_path is not None and is_run_folder(trace))
    run_command(analyse, sinks=Sinks(JsonSink(json_path), routing), device=device, inputs=[trace],
                kernels=[kernel_spec], force=force, progress=progress, details=details, usage=routing.check)


class RoutingSink(Sink):
    """``--save-routing PATH``: the kernel's routing that replay kept, as ids-only traces
    (:func:`routetool.analysis.replay.write_routing`): a file for a trace or an index (checked as
    every output file is), a new folder for a run folder."""

    flag = "--save-routing"

    def __init__(self, path: str | None, *, force: bool, run_folder: bool) -> None:
        super().__init__(path, announce=True)
        self.force = force
        self.run_folder = run_folder

    @property
    def to_stdout(self) -> bool:
        return False

    @property
    def output_path(self) -> str | None:
        return None if self.run_folder else self.path

    @property
    def output_folder(self) -> str | None:
        return self.path if self.run_folder else None

    def check(self) -> None:
        """A run folder's routing goes to a new folder (never into or over existing files).

        Raises:
            RouteToolError: ``-``; the folder exists; the folder above is missing or not writable.
        """
        if self.path is None:
            return
        if self.path == "-":
            raise RouteToolError("'-' (stdout) cannot take this output", path="-", fix="name a file")
        if self.run_folder:
            from routetool.io.paths import check_output_folder, path_kind

            if path_kind(self.path) != "missing":
                raise RouteToolError("already exists", path=self.path,
                                     fix="name a new folder: the routing of a run folder is a run folder of its own")
            check_output_folder(Path(self.path).parent)

    def write(self, report) -> list[str]:
        from routetool.analysis.replay import write_routing

        return [str(p) for p in write_routing(report.result, self.path, force=self.force)]
