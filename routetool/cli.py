"""routetool command line (click): parse options, call one function, render, choose the exit code."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from routetool import __version__
from routetool.cli_numbers import INT, FloatRange
from routetool.cli_paths import PATH, PATH_TEXT
from routetool.errors import EXIT_FINDINGS, EXIT_OK, EXIT_SIGNAL, EXIT_USAGE, RouteToolError, Terminated, printable
from routetool.execution import DEVICE_CHOICES, kernel_source, kernel_stdout
from routetool.report import Console, markup_safe
from routetool.numtext import list_items, parse_int, refuse_repeats


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While open, SIGTERM (from ``timeout``, a scheduler, CI) raises :class:`Terminated` in the
    main thread, so that the run unwinds as on Ctrl-C and removes its temporary files; the
    previous handler is restored afterwards. Outside the main thread (where no handler can be
    installed) or where SIGTERM is ignored (as Python leaves an ignored SIGINT), nothing changes."""
    installed = False
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
        installed = True
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)


def _stdout_closed() -> int:
    """The exit code after a write to a closed pipe (``routetool ... | head``): 141, as for a
    process SIGPIPE killed, never 1. Points stdout at the null device, so that the interpreter's
    flush at exit does not fail again on what is still buffered (Python's recipe, see the note
    on SIGPIPE in the signal module's documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's capture)
        pass
    return EXIT_SIGNAL + signal.SIGPIPE


class _Group(click.Group):
    """Maps errors to one-line messages and the documented exit codes, in one place.

    :class:`RouteToolError` -> its exit code (2 for bad input, 1 for a failing kernel);
    click's usage errors (unknown option, bad value) -> one line and exit 2; Ctrl-C -> exit 130,
    SIGTERM -> exit 143 (one line each, after the run's clean-up); a closed output pipe ->
    exit 141, silently.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except BrokenPipeError:  # `routetool --help | head -1` (click would make it exit 1)
            raise click.exceptions.Exit(_stdout_closed()) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # (click would write an empty line before its Abort)
            raise Terminated(signal.SIGINT) from None
        except RouteToolError as exc:
            click.echo(f"routetool: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except BrokenPipeError:  # (click would make it exit 1)
            ctx.exit(_stdout_closed())
        except OSError as exc:  # a path the checks let through (e.g. a file name over the system's limit)
            where = f"{exc.filename}: " if exc.filename is not None else ""
            click.echo(printable(f"routetool: error: {where}{exc.strerror or exc} (check the path)"), err=True)
            ctx.exit(EXIT_USAGE)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        with _sigterm_unwinds():
            code = self._run(args, prog_name, complete_var, **extra)
        sys.exit(code)

    def _run(self, args, prog_name, complete_var, **extra) -> int:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if sys.stdout is not None:
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "routetool"
            click.echo(printable(f"routetool: error: {exc.format_message()} (see `{command} --help`)"), err=True)
            return EXIT_USAGE
        except click.exceptions.Abort:
            click.echo("routetool: aborted", err=True)
            return EXIT_SIGNAL + signal.SIGINT
        except Terminated as exc:
            if exc.signum == signal.SIGINT:  # on a terminal, after the echoed ^C
                click.echo(("\n" if sys.stderr is not None and sys.stderr.isatty() else "") + "routetool: aborted",
                           err=True)
            else:
                click.echo(f"routetool: terminated by {signal.Signals(exc.signum).name}", err=True)
            return EXIT_SIGNAL + exc.signum
        except click.ClickException as exc:
            click.echo(printable(f"routetool: error: {exc.format_message()}"), err=True)
            return exc.exit_code
        except BrokenPipeError:
            return _stdout_closed()
        return rv if isinstance(rv, int) else EXIT_OK  # click returns the exit code of ctx.exit


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="routetool")
def main() -> None:
    """Profile and validate MoE top-k router kernels on captured gating traces.

    Exit codes: 0 ok, 1 the check found problems, 2 bad usage or bad input, 130 interrupted
    (Ctrl-C), 141 output pipe closed early, 143 terminated (SIGTERM).
    """


def _progress(enabled: bool) -> Progress:
    """A transient progress bar on stderr; off when stderr is not a terminal (logs, pipes)."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,
    )


def _finite(ctx, param, value):
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not nan")
    return value


@main.command()
@click.argument("trace", type=PATH)
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True,
              help="cuda: compiled kernels and latency; cpu: the Triton interpreter (no latency); auto: cuda if present.")
@click.option("--kernel", "kernel_spec", default="tiled", show_default=True,
              help="Kernel variant (tiled, seed) or module:function with the seed's signature.")
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
    """Replay TRACE through the routing kernel and the reference, and report.

    For every layer and captured step: classifies each token row (exact, reordered,
    tie-equivalent, mismatch, invalid), checks padding and weights, builds expert-load
    histograms, and on a GPU times each distinct step shape. Exit 1 on a real mismatch,
    invalid output or weight outside tolerance, or a kernel that fails (crashes, rejects the
    trace without documenting it); exit 2 when it rejects the trace as its docstring documents.
    """
    from routetool.files import check_output_paths, require_input

    require_input(trace)  # usage errors before torch is imported
    check_output_paths([json_path], force=force, inputs=[trace, kernel_source(kernel_spec)])
    from routetool.execution import load_kernel, select_execution
    from routetool.report import render_replay, replay_json, write_json
    from routetool.replay import parse_layers, replay_trace
    from routetool.trace import open_trace

    execution = select_execution(device)
    # a kernel's print() must not mix into the JSON on stdout
    with kernel_stdout(json_path == "-"):
        name, fn = load_kernel(kernel_spec)
        with open_trace(trace) as t:
            layers = parse_layers(layers_spec, t.layers, t.display_path)
            if histogram_layer is not None and histogram_layer not in layers:
                raise RouteToolError(f"--layer {histogram_layer} is not among the replayed layers",
                                     fix=f"choose among {', '.join(map(str, layers))}")
            total = sum(t.info(layer).num_tokens for layer in layers)
            with _progress(progress) as bar:
                task = bar.add_task(markup_safe(f"replay {trace.name} ({name})"), total=total)
                result = replay_trace(
                    t, name, fn, execution, layers=layers, tie_ulps=tie_ulps, measure_latency=latency,
                    progress=lambda n: bar.advance(task, n),
                )
    console = Console(stderr=json_path == "-")
    render_replay(result, console, histogram_layer, details=details)
    if json_path is not None:
        write_json(replay_json(result), json_path, sys.stdout)
    click.get_current_context().exit(result.verdict.exit_code)


@main.command()
@click.argument("traces", nargs=-1, type=PATH)
@click.option("--kernel", "kernel_spec", default="tiled", show_default=True,
              help="Kernel under test: a variant (tiled, seed) or module:function with the seed's signature.")
@click.option("--suite", type=click.Choice(["quick", "full", "none"]), default="quick", show_default=True,
              help="Built-in edge-case suite: quick (CPU-sized), full (all shapes; large ones need a GPU), none.")
@click.option("--family", "families", multiple=True,
              help="Only these suite families (repeatable): ties, nonfinite, bias, shapes, layouts, dtypes, padding, parameters.")
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True,
              help="cuda: compiled kernels, CUDA-graph cases; cpu: the Triton interpreter; auto: cuda if present.")
@click.option("--tie-ulps", type=FloatRange(min=0, max=1e6), default=16.0, show_default=True, callback=_finite,
              help="Near-tie tolerance in float32 ulps for tie-equivalent rows (0 = exact ties only).")
@click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write verdicts as JSON ('-' = stdout).")
@click.option("--junit", "junit_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write verdicts as JUnit XML ('-' = stdout).")
@click.option("--force", is_flag=True, help="Replace existing --json/--junit files.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def validate(traces: tuple[Path, ...], kernel_spec: str, suite: str, families: tuple[str, ...], device: str,
             tie_ulps: float, json_path: str | None, junit_path: str | None, force: bool, progress: bool) -> None:
    """Validate a routing kernel before deployment, on the edge-case suite and on TRACES.

    Every case ends in pass, pass with tie-equivalent rows, a documented rejection (of a suite
    case's unusual input; a kernel that rejects a trace fails), skipped, or fail (with the failure
    class, the first offending rows, their inputs and both outputs). Exit 0 when nothing failed,
    1 otherwise.
    """
    from routetool.files import check_output_paths, require_input

    if json_path == "-" and junit_path == "-":
        raise RouteToolError("--json - and --junit - both want stdout", fix="write one of them to a file")
    for t in traces:  # usage errors before torch is imported
        require_input(t)
    check_output_paths([json_path, junit_path], force=force, inputs=[*traces, kernel_source(kernel_spec)])
    if suite == "none" and not traces:
        raise RouteToolError("nothing to validate: --suite none and no trace given", fix="give a trace or a suite")
    from routetool.execution import load_kernel, select_execution
    from routetool.report import render_validate, validate_json, validate_junit, write_json, write_text
    from routetool.suite import build_suite
    from routetool.trace import open_trace
    from routetool.validate import trace_labels
    from routetool.validate import validate as run_validate

    try:
        cases = [] if suite == "none" else build_suite(suite, list(families) or None)
    except ValueError as exc:
        raise RouteToolError(str(exc), fix="see `routetool validate --help`") from None
    for t in traces:  # bad traces fail before any work
        open_trace(t).close()
    trace_labels(traces)  # one file given twice fails before any work too
    execution = select_execution(device)
    with kernel_stdout("-" in (json_path, junit_path)):  # a kernel's print() must not mix into the document
        name, fn = load_kernel(kernel_spec)
        with _progress(progress) as bar:
            task = bar.add_task(markup_safe(f"validate {name}"), total=len(cases) + len(traces))
            result = run_validate(fn, name, execution, cases=cases, traces=traces,
                                  suite=None if suite == "none" else suite, tie_ulps=tie_ulps,
                                  progress=lambda _: bar.advance(task))
    console = Console(stderr="-" in (json_path, junit_path))
    render_validate(result, console)
    if json_path is not None:
        write_json(validate_json(result), json_path, sys.stdout)
    if junit_path is not None:
        write_text(validate_junit(result), junit_path, sys.stdout)
    click.get_current_context().exit(result.exit_code)


def _int_list(text: str, name: str) -> list[int]:
    values = [parse_int(v) for v in list_items(name, text, "1,64,4096")]
    if any(v is None for v in values):
        raise RouteToolError(f"{name} {text!r} is not a comma-separated list of integers", fix="e.g. 1,64,4096")
    if any(v < 1 for v in values):
        raise RouteToolError(f"{name} {text!r} needs positive integers", fix="e.g. 1,64,4096")
    return refuse_repeats(name, text, values)


@main.command()
@click.option("--tokens", default="1,8,64,256,1024,4096,16384,65536", show_default=True,
              help="Comma-separated num_tokens to sweep (each at most 16777216, 2^24).")
@click.option("--trace", "trace_path", type=PATH, default=None,
              help="Also sweep the step shapes of this trace (and use its num_experts/topk unless given).")
@click.option("--experts", default=None, help="Comma-separated num_experts [default: 128,256,384,512].")
@click.option("--topk", "topks", default=None, help="Comma-separated topk [default: 8].")
@click.option("--dtype", "dtypes", default="fp32,bf16", show_default=True, help="Gating dtypes: fp32, bf16, fp16.")
@click.option("--kernel", "kernels", multiple=True,
              help="Kernels (repeatable): tiled, seed, torch, torch-compile, module:function [default: tiled, seed, torch].")
@click.option("--baseline", default="seed", show_default=True, help="Kernel the speedup is relative to.")
@click.option("--pdl", type=click.Choice(["on", "off", "both"]), default="on", show_default=True,
              help="Programmatic dependent launch for the project's variants.")
@click.option("--graph/--no-graph", default=True, show_default=True, help="Time under CUDA-graph replay.")
@click.option("--rep-ms", type=FloatRange(min=1, max=60_000), default=20.0, show_default=True, callback=_finite,
              help="Timing budget per point and kernel, in milliseconds (1-60000).")
@click.option("--csv", "csv_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write the long-format CSV ('-' = stdout).")
@click.option("--json", "json_path", type=PATH_TEXT, default=None, metavar="PATH", help="Write the results as JSON ('-' = stdout).")
@click.option("--force", is_flag=True, help="Replace existing output files.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
def bench(tokens: str, trace_path: Path | None, experts: str | None, topks: str | None, dtypes: str,
          kernels: tuple[str, ...], baseline: str, pdl: str, graph: bool, rep_ms: float, csv_path: str | None,
          json_path: str | None, force: bool, progress: bool) -> None:
    """Time routing kernels over a sweep of shapes on a CUDA GPU.

    Each kernel's first call on a point is judged by the one kernel contract and validate's checks
    before timing: a kernel that fails is reported, not timed (exit 1); a documented rejection (the
    seed and bf16) is reported as rejected. Reports p10/p50/p90 latency (µs) under CUDA graphs,
    the host cost per eager call against an empty Triton launch, achieved bandwidth and its
    fraction of the measured copy bandwidth, and the speedup over --baseline.
    """
    import torch

    from routetool.bench import DTYPES, MAX_TOKENS, check_fits, resolve_kernels, run_bench, trace_step_shapes
    from routetool.execution import select_execution
    from routetool.files import check_output_paths
    from routetool.report import bench_csv, bench_json, render_bench, write_json, write_text

    if csv_path == "-" and json_path == "-":
        raise RouteToolError("--csv - and --json - both want stdout", fix="write one of them to a file")
    check_output_paths([csv_path, json_path], force=force, inputs=[trace_path, *map(kernel_source, kernels)])
    token_list = _int_list(tokens, "--tokens")
    if max(token_list) > MAX_TOKENS:
        raise RouteToolError(f"--tokens {tokens!r}: {max(token_list)} tokens per point is above bench's limit of "
                             f"{MAX_TOKENS} (2^24)",
                             fix="choose at most 16777216 tokens; 2^24 tokens of fp32 logits at 512 experts are 32 GiB")
    expert_list = _int_list(experts, "--experts") if experts else None
    topk_list = _int_list(topks, "--topk") if topks else None
    if trace_path is not None:
        shapes, router = trace_step_shapes(trace_path)
        token_list = sorted(set(token_list) | set(shapes))
        expert_list = expert_list or [router.num_experts]
        topk_list = topk_list or [router.topk]
    expert_list = expert_list or [128, 256, 384, 512]
    topk_list = topk_list or [8]
    dtype_list = list_items("--dtype", dtypes, "fp32,bf16")  # "fp32,,bf16" ran as fp32,bf16
    unknown = [d for d in dtype_list if d not in DTYPES]
    if unknown:
        raise RouteToolError(f"--dtype {dtypes!r}", fix=f"use a comma-separated subset of {', '.join(DTYPES)}")
    refuse_repeats("--dtype", dtypes, dtype_list)
    points = sum(1 for e in expert_list for k in topk_list if k <= e)
    if not points:
        raise RouteToolError(f"every --topk ({', '.join(map(str, topk_list))}) exceeds every expert count "
                             f"({', '.join(map(str, expert_list))}): nothing to time",
                             fix="choose topk <= num_experts")
    # kernels resolved (names checked, modules imported) before the GPU check, so that a
    # mistake in the options shows on any machine
    has_cuda = torch.cuda.is_available()
    select_execution("cuda" if has_cuda else "cpu")
    repeated = next((k for i, k in enumerate(kernels) if k in kernels[:i]), None)
    if repeated is not None:  # it would be timed twice
        raise RouteToolError(f"--kernel {repeated} is given twice", fix="give each kernel once")
    specs = list(kernels) or ["tiled", "seed", "torch"]
    with kernel_stdout("-" in (csv_path, json_path)):  # a kernel's print() must not mix into the document
        bench_kernels = resolve_kernels(specs, pdl)
        explicit = click.get_current_context().get_parameter_source("baseline") != click.core.ParameterSource.DEFAULT
        if explicit and baseline not in {k.name for k in bench_kernels}:
            raise RouteToolError(f"--baseline {baseline!r} is not among the timed kernels ({', '.join(specs)})",
                                 fix="name one of the --kernel values, or add it with --kernel")
        if not has_cuda:
            raise RouteToolError("bench needs a CUDA GPU; this machine has none",
                                 fix="run it on a GPU machine (replay and validate work on the CPU)")
        check_fits(token_list, expert_list, topk_list, dtype_list, torch.cuda.mem_get_info()[0],
                   f"the GPU ({torch.cuda.get_device_name()})")
        total = len(bench_kernels) * len(token_list) * len(dtype_list) * points
        with _progress(progress) as bar:
            task = bar.add_task("bench", total=total)
            result = run_bench(bench_kernels, token_list, expert_list, topk_list, dtype_list, baseline=baseline,
                               use_graph=graph, rep_ms=rep_ms, progress=lambda _: bar.advance(task))
    render_bench(result, Console(stderr="-" in (csv_path, json_path)))
    if csv_path is not None:
        write_text(bench_csv(result), csv_path, sys.stdout)
    if json_path is not None:
        write_json(bench_json(result), json_path, sys.stdout)
    broken = [r for r in result.rows if r.status.startswith("failed")]
    click.get_current_context().exit(EXIT_FINDINGS if broken else EXIT_OK)


def _register() -> None:
    from routetool.cli_balance import balance, import_
    from routetool.cli_capture import capture, info, synth

    for command in (synth, info, capture, balance, import_):
        main.add_command(command)


_register()
