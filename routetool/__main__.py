"""``python -m routetool`` and the ``routetool`` console script.

SIGTERM is answered from the first line routetool runs to the process's end: until the command
group installs the handler that unwinds a run (and after it is done), nothing needs cleaning up,
so SIGTERM ends the process at once with the documented exit code 143 and its one line, never
with the default action (a process killed by signal 15, which a shell reports as -15 / 143
without routetool's line, and which CI reads as a crash). Ctrl-C likewise: a KeyboardInterrupt
that reaches the entry point (while the command group is imported, or on the way out) is exit
130 and routetool's line, never Python's traceback and a process killed by SIGINT.
"""

import os
import signal
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
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _terminate_now)
    try:
        from routetool.cli import main as cli

        cli()  # (a Ctrl-C inside a command is the command group's: it unwinds the run and exits 130)
    except KeyboardInterrupt:
        _leave_now(b"routetool: aborted\n", _INTERRUPTED)


if __name__ == "__main__":
    main()
