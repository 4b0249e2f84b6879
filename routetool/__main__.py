"""``python -m routetool`` and the ``routetool`` console script.

SIGTERM is answered from the first line routetool runs to the process's end: until the command
group installs the handler that unwinds a run (and after it is done), nothing needs cleaning up,
so SIGTERM ends the process at once with the documented exit code 143 and its one line, never
with the default action (a process killed by signal 15, which a shell reports as -15 / 143
without routetool's line, and which CI reads as a crash). Ctrl-C likewise: a KeyboardInterrupt
that reaches the entry point (while the command group is imported, or on the way out) is exit
130 and routetool's line, never Python's traceback and a process killed by SIGINT.

The end of the process is routetool's too: the interpreter's teardown (freeing every module,
about 0.4 s with torch loaded) runs no Python signal handler, so a signal there met the default
action (-15, -2) after the report was written. Once the command is done, routetool flushes its
output, runs the ``atexit`` handlers with its handlers in place and ends the process with the
command's exit code (``os._exit``), unless a thread is still running (the interpreter joins it).

The CPU's threads are routetool's to schedule as well: before torch is imported, the OpenMP
threads of its CPU operations are told to sleep between operations (``OMP_WAIT_POLICY=PASSIVE``,
unless the environment sets it) instead of spinning for them. The CPU work of a command (the
reference routing, the measures) is thousands of operations of a few milliseconds; on a machine
whose cores are shared with other work, a thread spinning at the end of each one held the core
the other thread needed to finish it, and ``routetool diff`` on 2 cores, one of them busy, took
2.5x-3x as long (docs/diff.md, Speed). The results are the same either way.
"""

import atexit
import os
import signal
import sys
import threading

_TERMINATED_BY_SIGTERM = 128 + signal.SIGTERM
_INTERRUPTED = 128 + signal.SIGINT


def _leave_now(line: bytes, code: int) -> None:
    """Outside a running command (importing, leaving) nothing needs cleaning up: ``line`` and exit ``code`` at once."""
    if os.environ.get("RANK", "0") == "0":  # (under torchrun, only the first process speaks)
        try:
            os.write(2, line)
        except OSError:
            pass
    os._exit(code)


def _terminate_now(signum, frame) -> None:
    """SIGTERM outside a running command: exit 143."""
    _leave_now(b"routetool: terminated by SIGTERM\n", _TERMINATED_BY_SIGTERM)


def main() -> None:
    """Install the SIGTERM answer (where SIGTERM is not ignored), then run the command group."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (read once, when torch loads OpenMP: see above)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _terminate_now)
    try:
        from routetool.cli import main as cli

        cli()  # (a Ctrl-C inside a command is the command group's: it unwinds the run and exits 130)
        code = 0
    except KeyboardInterrupt:
        _leave_now(b"routetool: aborted\n", _INTERRUPTED)
    except SystemExit as exc:
        code = exc.code
    _end(code)


def _interrupt_now(signum, frame) -> None:
    """Ctrl-C after the command: exit 130."""
    _leave_now(b"routetool: aborted\n", _INTERRUPTED)


def _end(code) -> None:
    """End the process with ``code`` (``sys.exit``'s argument) after flushing the output and running
    the ``atexit`` handlers, without the interpreter's teardown (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread() or threading.active_count() > 1:
        sys.exit(code)  # (a thread still running: the interpreter joins it, as it always did)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_now)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # (as the interpreter does with sys.exit("text"))
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # (a closed pipe was the command's to report)
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main()
