"""The ``routetool`` command group: the one mapping from errors to exit codes (and signals, closed
pipes), and the registration of the commands, one thin module each."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import click

from routetool import __version__
from routetool.errors import (
    EXIT_OK,
    EXIT_SIGNAL,
    EXIT_USAGE,
    RouteToolError,
    Terminated,
    first_line,
    is_allocation_failure,
    printable,
)


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


def _first_process() -> bool:
    """Whether this process speaks: alone, or rank 0 of a torchrun job (every process meets the
    same error, and one line of it is enough)."""
    from routetool.engine.distributed import launched

    return not launched() or os.environ.get("RANK") == "0"


def _signal_exit(exc: Terminated) -> int:
    """The one line for a run a signal stopped (by the first process only), and its exit code:
    130 for Ctrl-C, 143 for SIGTERM."""
    if not _first_process():
        pass
    elif exc.signum == signal.SIGINT:  # on a terminal, after the echoed ^C
        click.echo(("\n" if sys.stderr is not None and sys.stderr.isatty() else "") + "routetool: aborted", err=True)
    else:
        click.echo(f"routetool: terminated by {signal.Signals(exc.signum).name}", err=True)
    return EXIT_SIGNAL + exc.signum


class _Group(click.Group):
    """Maps errors to one-line messages and the documented exit codes, in one place.

    :class:`RouteToolError` -> its exit code (2 for bad input, 1 for a failing kernel);
    click's usage errors (unknown option, bad value) -> one line and exit 2; Ctrl-C -> exit 130,
    SIGTERM -> exit 143 (one line each, after the run's clean-up); a closed output pipe ->
    exit 141, silently.
    """

    def make_context(self, info_name, args, parent=None, **extra):
        from routetool.cli.command import ARGV

        argv = list(args)
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except BrokenPipeError:  # `routetool --help | head -1` (click would make it exit 1)
            raise click.exceptions.Exit(_stdout_closed()) from None
        ctx.meta[ARGV] = argv  # (the command line as run, for --html's page)
        return ctx

    def invoke(self, ctx: click.Context):
        from routetool.io.inputs import forget_claims

        forget_claims()  # (what an interrupted command in this process may have left)
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # (click would write an empty line before its Abort)
            raise Terminated(signal.SIGINT) from None
        except RouteToolError as exc:
            speaks = getattr(exc, "speaks", None)  # (a lost torchrun peer: its first reporter, any rank)
            if _first_process() if speaks is None else speaks:
                click.echo(f"routetool: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except BrokenPipeError:  # (click would make it exit 1)
            ctx.exit(_stdout_closed())
        except (MemoryError, RuntimeError) as exc:  # an allocation the input forces: bad input, one line
            if not is_allocation_failure(exc):
                raise
            if _first_process():
                click.echo(printable(f"routetool: error: cannot allocate the memory this input needs "
                                     f"({first_line(exc)[:200]}) (run on a machine with more memory, or read fewer "
                                     "layers or steps)"), err=True)
            ctx.exit(EXIT_USAGE)
        except OSError as exc:  # a path the checks let through (e.g. a file name over the system's limit)
            where = f"{exc.filename}: " if exc.filename is not None else ""
            click.echo(printable(f"routetool: error: {where}{exc.strerror or exc} (check the path)"), err=True)
            ctx.exit(EXIT_USAGE)
        finally:
            forget_claims()  # (a command's claims end with it: a later write in this process is its own)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        first = _first_process()
        if not first:  # under torchrun only the first process writes to stdout (help, reports, JSON)
            sys.stdout = open(os.devnull, "w")
        with _sigterm_unwinds():
            code = self._run(args, prog_name, complete_var, **extra)
            try:
                joined = False
                if "routetool.engine.distributed" in sys.modules:  # a torchrun job: leave together
                    from routetool.engine.distributed import leave

                    joined = leave()
                if not first and code != EXIT_OK and not joined:
                    # failed before the group was joined (a usage error): give the first process the moment
                    # it needs to print its line before torchrun, seeing this exit, stops it
                    time.sleep(1.0)
            except Terminated as exc:  # (SIGTERM or Ctrl-C while the processes leave together)
                code = _signal_exit(exc)
            except KeyboardInterrupt:
                code = _signal_exit(Terminated(signal.SIGINT))
        # from here to the end, SIGTERM is the entry point's (routetool.__main__): exit 143 at once
        sys.exit(code)

    def _run(self, args, prog_name, complete_var, **extra) -> int:
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if sys.stdout is not None:
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        except click.exceptions.NoArgsIsHelpError as exc:  # `routetool`, `routetool capture`: no command named
            if _first_process():
                exc.show()  # the group's help, as click prints it: on stderr, exit 2 (a usage error)
            return EXIT_USAGE
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "routetool"
            if _first_process():
                click.echo(printable(f"routetool: error: {exc.format_message()} (see `{command} --help`)"), err=True)
            return EXIT_USAGE
        except click.exceptions.Abort:
            if _first_process():
                click.echo("routetool: aborted", err=True)
            return EXIT_SIGNAL + signal.SIGINT
        except Terminated as exc:
            return _signal_exit(exc)
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


def _register() -> None:
    from routetool.cli.balance import balance, import_
    from routetool.cli.bench import bench
    from routetool.cli.capture import capture, info, synth
    from routetool.cli.command import add_html_option
    from routetool.cli.diff import diff
    from routetool.cli.replay import replay
    from routetool.cli.validate import validate

    for command in (replay, validate, bench, balance, diff):  # the reports worth attaching to an issue
        add_html_option(command)
    for command in (replay, validate, bench, synth, info, capture, balance, import_, diff):
        main.add_command(command)


_register()


