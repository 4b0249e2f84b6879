"""The command base: the options every command shares, and the one skeleton of a run.

Each command module declares its own options and its analysis step; the base does the rest,
in this order (:func:`run_command`)::

    join the torchrun group (commands with --device)  ->  the command's own usage checks
    ->  the stdout rule of its sinks  ->  inputs there, output paths writable (before torch)
    ->  analyse(run) with a kernel's print() kept out of a document on stdout
    ->  on the first process: report.terminal(console), then every sink  ->  exit with the
        report's code

A command reads like::

    @click.command()
    @click.argument("trace", type=PATH)
    @device_option("...")
    @json_option("...")
    @force_option("Replace an existing --json file.")
    @progress_option()
    def replay(trace, device, json_path, force, progress):
        def analyse(run: Run) -> ReplayReport:
            with run.progress() as bar:
                ...
            return ReplayReport(result)

        run_command(analyse, sinks=Sinks(JsonSink(json_path)), device=device, inputs=[trace], force=force,
                    progress=progress)

The paths are checked through :func:`require_input` and :func:`check_output_paths` here, the
command line's one door to them.

``--html PATH`` is the base's own: :func:`add_html_option` gives it to a command (the group does,
for replay, validate, bench, balance and diff), and :func:`run_command` adds its sink, so that a
command declares nothing for it.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from routetool.cli.paths import PATH_TEXT
from routetool.engine.execution import DEVICE_CHOICES, SEED_SIGNATURE, kernel_source, kernel_stdout
from routetool.report.sinks import HtmlSink, Sinks
from routetool.report.tables import Console

KERNEL_SIGNATURE_HELP = (f"A module:function kernel takes the seed's signature, {SEED_SIGNATURE}: the logits and "
                         "the bias by position, the rest by keyword.")
"""Appended to every command's ``--kernel`` help: the signature a ``module:function`` must take."""


# ---------------------------------------------------------------------------------------
# shared options: the names, types and defaults in one place, each command's help its own
def device_option(help: str):
    """``--device cuda|cpu|auto`` (default auto)."""
    return click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True, help=help)


def kernel_option(help: str, show_default: bool | str = True, default: str = "tiled"):
    """``--kernel`` (``kernel_spec``, default tiled): ``help`` then the signature a module:function takes."""
    return click.option("--kernel", "kernel_spec", default=default, show_default=show_default,
                        help=f"{help} {KERNEL_SIGNATURE_HELP}")


def output_option(flag: str, name: str, help: str):
    """A document's path (``'-'`` = stdout), e.g. ``--junit`` into ``junit_path``."""
    return click.option(flag, name, type=PATH_TEXT, default=None, metavar="PATH", help=help)


ARGV = "routetool.argv"
"""``click.Context.meta`` key: the arguments the command group was given (set by the group)."""

HTML_PATH = "routetool.html_path"
"""``click.Context.meta`` key: the ``--html`` path (None: not asked for)."""

HTML_HELP = ("Also write the report as one self-contained HTML page to PATH ('-' = stdout): the verdict, every table, "
             "the figures (with the plot extra), the exact command, versions, machine and commit; it loads nothing "
             "from the network. An existing file is replaced only with --force.")


def _keep_html_path(ctx: click.Context, param, value):
    ctx.meta[HTML_PATH] = value
    return value


def add_html_option(command: click.Command) -> click.Command:
    """Give ``command`` the ``--html PATH`` option (after its ``--json``): its value is kept for
    :func:`run_command`, which writes the page, so the command's function takes no argument for it."""
    option = click.Option(["--html", "html_path"], type=PATH_TEXT, default=None, metavar="PATH", expose_value=False,
                          callback=_keep_html_path, help=HTML_HELP)
    names = [p.name for p in command.params]
    command.params.insert(names.index("json_path") + 1 if "json_path" in names else len(names), option)
    return command


def command_line(ctx: click.Context) -> str | None:
    """The command line as run, ``routetool ARGS`` quoted for a shell (None where the group did not
    record its arguments)."""
    argv = ctx.meta.get(ARGV)
    return None if argv is None else shlex.join(["routetool", *argv])


def json_option(help: str):
    """``--json PATH`` (``json_path``)."""
    return output_option("--json", "json_path", help)


def details_option(help: str):
    """``--details`` / ``-v``: every table instead of the one-screen summary."""
    return click.option("--details", "-v", "details", is_flag=True, help=help)


def force_option(help: str):
    """``--force``: replace existing outputs."""
    return click.option("--force", is_flag=True, help=help)


def progress_option(help: str = "Progress bar on stderr."):
    """``--progress/--no-progress`` (default on)."""
    return click.option("--progress/--no-progress", default=True, show_default=True, help=help)


def finite(ctx, param, value):
    """An option callback refusing nan (click's float types read it)."""
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not nan")
    return value


# ---------------------------------------------------------------------------------------
# paths: the command line's one door to the input and output checks
def require_input(path, **kwargs) -> str:
    """:func:`routetool.io.paths.require_input`: an input that is not there, refused in one line."""
    from routetool.io.inputs import require_input as require

    return require(path, **kwargs)


def check_output_paths(outputs, **kwargs) -> None:
    """:func:`routetool.io.inputs.check_output_paths`: outputs checked before any work."""
    from routetool.io.inputs import check_output_paths as check

    check(outputs, **kwargs)


# ---------------------------------------------------------------------------------------
# the run
def progress_bar(enabled: bool, percent: bool = False) -> Progress:
    """Every command's progress bar: transient, on stderr, counting done/total (``percent``: a
    percentage). Off where stderr is not a terminal (logs, pipes): there a transient bar leaves
    an empty line behind, which would put a blank line before the output and make a one-line
    error two lines."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TaskProgressColumn() if percent else MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not enabled or not console.is_terminal,
    )


class Run:
    """What a command's analysis step gets from the base: the torchrun group (``workers``, None
    for a command without one) and the progress bar (``--progress``, first process only)."""

    def __init__(self, workers, progress: bool) -> None:
        self.workers = workers
        self._progress = progress

    @property
    def is_first(self) -> bool:
        """Whether this process reports: alone, or the first of a torchrun group."""
        return self.workers is None or self.workers.is_first

    def progress(self, shown: bool = True, percent: bool = False) -> Progress:
        """The progress bar, shown where ``--progress``, ``shown`` and this process is the first."""
        return progress_bar(self._progress and shown and self.is_first, percent=percent)


def run_command(analyse: Callable[[Run], object], *, sinks: Sinks | None = None, device: str | None = None,
                inputs: Iterable = (), input_what: str = "file", reads: Iterable = (), kernels: Iterable = (),
                force: bool = False, progress: bool = True, details: bool = False,
                usage: Callable[[], None] | None = None) -> None:
    """Run a command (see the module docstring) and exit with its report's code.

    Args:
        analyse: the command's own step: takes a :class:`Run`, returns a report
            (:class:`routetool.report.protocol.Report`); it parses and checks what is left, loads
            its kernel, opens its inputs and runs.
        sinks: the documents to write (:mod:`routetool.report.sinks`); ``--html``'s page is added
            to them here (:func:`add_html_option`).
        device: the ``--device`` choice: the process joins the torchrun group with it first, so
            that every process ends with the group; None: a command without one.
        inputs: paths that must exist (``input_what``: ``file`` or ``file or folder``).
        reads: other inputs (may be None), which no output may replace; ``kernels``: the
            ``--kernel`` specs, whose ``.py`` files count as inputs too.
        force: outputs may replace existing files.
        progress: ``--progress``; details: ``--details``.
        usage: the command's checks of its options, run first after the join.

    Raises:
        RouteToolError: bad usage or input (exit 2), a failing kernel (exit 1).
    """
    sinks = sinks or Sinks()
    ctx = click.get_current_context()
    if ctx.meta.get(HTML_PATH) is not None:
        sinks = sinks.adding(HtmlSink(ctx.meta[HTML_PATH], name=ctx.info_name, command=command_line(ctx)))
    workers = None
    if device is not None:
        from routetool.engine.distributed import join

        workers = join(device)  # under torchrun: the group first, so that every process ends with it
    if usage is not None:
        usage()
    sinks.check()
    inputs = list(inputs)
    for path in inputs:  # usage errors before torch is imported
        require_input(path, what=input_what)
    check_output_paths(sinks.paths, force=force, inputs=[*inputs, *reads, *map(kernel_source, kernels)],
                       folders=sinks.folders)
    run = Run(workers, progress)
    with kernel_stdout(sinks.to_stdout):  # a kernel's print() must not mix into a document on stdout
        report = analyse(run)
    if run.is_first:
        report.terminal(Console(stderr=sinks.to_stdout), details=details)
        sinks.write(report)
    ctx.exit(report.exit_code)
