"""``routetool validate``: check the paths, build the suite, run it and the traces, render, exit
with the result's code."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from routetool.cli.common import KERNEL_SIGNATURE_HELP, _finite, _progress
from routetool.cli.numbers import FloatRange
from routetool.cli.paths import PATH, PATH_TEXT
from routetool.engine.execution import DEVICE_CHOICES, kernel_source, kernel_stdout
from routetool.errors import RouteToolError
from routetool.report.tables import Console, markup_safe


@click.command()
@click.argument("traces", nargs=-1, type=PATH)
@click.option("--kernel", "kernel_spec", default="tiled", show_default=True,
              help="Kernel under test: a variant (tiled, seed) or module:function. " + KERNEL_SIGNATURE_HELP)
@click.option("--suite", type=click.Choice(["quick", "full", "none"]), default="quick", show_default=True,
              help="Built-in edge-case suite: quick (CPU-sized), full (all shapes; large ones need a GPU), none.")
@click.option("--family", "families", multiple=True,
              help="Only these suite families (repeatable): ties, nonfinite, bias, shapes, models, layouts, dtypes, padding, "
                   "parameters.")
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True,
              help="cuda: compiled kernels, CUDA-graph cases; cpu: the Triton interpreter; auto: cuda if present.")
@click.option("--tie-ulps", type=FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=_finite,
              help="Near-tie tolerance in float32 ulps for tie-equivalent rows (0 = exact ties only).")
@click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write verdicts as JSON ('-' = stdout).")
@click.option("--junit", "junit_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write verdicts as JUnit XML ('-' = stdout).")
@click.option("--details", "-v", "details", is_flag=True,
              help="Also every case with its verdict and message, and every failing case in full.")
@click.option("--force", is_flag=True, help="Replace existing --json/--junit files.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def validate(traces: tuple[Path, ...], kernel_spec: str, suite: str, families: tuple[str, ...], device: str,
             tie_ulps: float, json_path: str | None, junit_path: str | None, details: bool, force: bool,
             progress: bool) -> None:
    """Validate a routing kernel before deployment, on the edge-case suite and on TRACES.

    Every case ends in pass, pass with tie-equivalent rows, a documented rejection (of a suite
    case's unusual input; a kernel that rejects a trace fails), skipped, or fail (with the failure
    class, the first offending rows, their inputs and both outputs). Exit 0 when nothing failed,
    1 otherwise.

    Each TRACE is a trace file, an index or a run folder (one family per rank). Under
    `torchrun --nproc-per-node N -m routetool validate ...` the cases and the traces' layers are
    shared among the N processes and the first process reports.
    """
    from routetool.engine.distributed import join

    workers = join(device)  # under torchrun: the group first, so that every process ends with it
    from routetool.io.inputs import check_output_paths, require_input

    if json_path == "-" and junit_path == "-":
        raise RouteToolError("--json - and --junit - both want stdout", fix="write one of them to a file")
    for t in traces:  # usage errors before torch is imported
        require_input(t)
    check_output_paths([json_path, junit_path], force=force, inputs=[*traces, kernel_source(kernel_spec)])
    if suite == "none" and not traces:
        raise RouteToolError("nothing to validate: --suite none and no trace given", fix="give a trace or a suite")
    from routetool.analysis.suite import build_suite
    from routetool.analysis.validate import trace_labels
    from routetool.analysis.validate import validate as run_validate
    from routetool.engine.execution import load_kernel, select_execution
    from routetool.report.formats import write_json, write_text
    from routetool.report.validate import render_validate, validate_json, validate_junit

    try:
        cases = [] if suite == "none" else build_suite(suite, list(families) or None)
    except ValueError as exc:
        raise RouteToolError(str(exc), fix="see `routetool validate --help`") from None
    trace_labels(traces)  # one file given twice fails before any work (bad traces too: run_validate opens them first)
    execution = select_execution(device)
    with kernel_stdout("-" in (json_path, junit_path)):  # a kernel's print() must not mix into the document
        name, fn = load_kernel(kernel_spec)
        execution = execution.for_kernel(fn)  # a plain torch kernel on the CPU: no Triton interpreter
        with _progress(progress and workers.is_first) as bar:
            task = bar.add_task(markup_safe(f"validate {name}"), total=None)
            result = run_validate(fn, name, execution, cases=cases, traces=traces,
                                  suite=None if suite == "none" else suite, tie_ulps=tie_ulps,
                                  progress=lambda _: bar.advance(task), planned=lambda n: bar.update(task, total=n),
                                  workers=workers)
    if workers.is_first:
        console = Console(stderr="-" in (json_path, junit_path))
        render_validate(result, console, details=details)
        if json_path is not None:
            write_json(validate_json(result), json_path, sys.stdout)
        if junit_path is not None:
            write_text(validate_junit(result), junit_path, sys.stdout)
    click.get_current_context().exit(result.exit_code)
