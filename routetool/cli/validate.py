"""``routetool validate``: its options and its analysis step (build the suite, run it and the
traces through the kernel); the command base (routetool.cli.command) checks the paths, renders
and exits."""

from __future__ import annotations

from pathlib import Path

import click

from routetool.cli.command import (
    Run, details_option, device_option, finite, force_option, json_option, kernel_option, output_option,
    progress_option, run_command
)
from routetool.cli.paths import PATH
from routetool.errors import RouteToolError
from routetool.report.sinks import JsonSink, JUnitSink, Sinks
from routetool.report.tables import markup_safe


@click.command()
@click.argument("traces", nargs=-1, type=PATH)
@kernel_option("Kernel under test: a variant (tiled, seed) or module:function.")
@click.option("--suite", type=click.Choice(["quick", "full", "none"]), default="quick", show_default=True,
              help="Built-in edge-case suite: quick (CPU-sized), full (all shapes; large ones need a GPU), none.")
@click.option("--family", "families", multiple=True,
              help="Only these suite families (repeatable): ties, nonfinite, bias, shapes, models, layouts, dtypes, padding, "
                   "parameters.")
@device_option("cuda: compiled kernels, CUDA-graph cases; cpu: the Triton interpreter; auto: cuda if present.")
@click.option("--tie-ulps", type=click.FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=finite,
              help="Near-tie tolerance in float32 ulps for tie-equivalent rows (0 = exact ties only).")
@json_option("Write verdicts as JSON ('-' = stdout).")
@output_option("--junit", "junit_path", "Write verdicts as JUnit XML ('-' = stdout).")
@details_option("Also every case with its verdict and message, and every failing case in full.")
@force_option("Replace existing --json/--junit/--html files.")
@progress_option()
def validate(traces: tuple[Path, ...], kernel_spec: str, suite: str, families: tuple[str, ...], device: str,
             tie_ulps: float, json_path: str | None, junit_path: str | None, details: bool, force: bool,
             progress: bool) -> None:
    """Validate a routing kernel before deployment, on the edge-case suite and on TRACES.

    Every case ends in pass, pass with tie-equivalent rows, a documented rejection (of a suite
    case's unusual input; a kernel that rejects a trace fails), skipped, or fail (with the failure
    class, the first offending rows, their inputs and both outputs). Exit 0 when nothing failed,
    2 when the only failures are a trace the kernel rejects as its docstring documents (choose a
    kernel that routes it), 1 otherwise.

    Each TRACE is a trace file, an index or a run folder (one family per rank). Under
    `torchrun --nproc-per-node N -m routetool validate ...` the cases and the traces' layers are
    shared among the N processes and the first process reports.
    """

    def analyse(run: Run):
        if suite == "none" and not traces:
            raise RouteToolError("nothing to validate: --suite none and no trace given", fix="give a trace or a suite")
        from routetool.analysis.suite import build_suite
        from routetool.analysis.validate import trace_labels
        from routetool.analysis.validate import validate as run_validate
        from routetool.engine.execution import load_kernel, select_execution
        from routetool.report.validate import ValidateReport

        try:
            cases = [] if suite == "none" else build_suite(suite, list(families) or None)
        except ValueError as exc:
            raise RouteToolError(str(exc), fix="see `routetool validate --help`") from None
        # one file given twice fails before any work (bad traces too: run_validate opens them first)
        trace_labels(traces)
        execution = select_execution(device)
        name, fn = load_kernel(kernel_spec)
        execution = execution.for_kernel(fn)  # a plain torch kernel on the CPU: no Triton interpreter
        with run.progress() as bar:
            task = bar.add_task(markup_safe(f"validate {name}"), total=None)
            result = run_validate(fn, name, execution, cases=cases, traces=traces,
                                  suite=None if suite == "none" else suite, tie_ulps=tie_ulps,
                                  progress=lambda _: bar.advance(task), planned=lambda n: bar.update(task, total=n),
                                  workers=run.workers)
        return ValidateReport(result)

    run_command(analyse, sinks=Sinks(JsonSink(json_path), JUnitSink(junit_path)), device=device, inputs=traces,
                kernels=[kernel_spec], force=force, progress=progress, details=details)
