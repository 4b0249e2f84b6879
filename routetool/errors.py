"""The one error type for user-facing failures, and the exit codes routetool documents."""

from __future__ import annotations

EXIT_OK = 0
"""Everything checked passed."""
EXIT_FINDINGS = 1
"""The check ran and found problems (real mismatches, invalid outputs, failed cases)."""
EXIT_USAGE = 2
"""Bad usage or bad input (unreadable trace, wrong tensor, impossible parameter)."""
EXIT_SIGNAL = 128
"""Stopped by a signal: the exit code is this plus the signal's number, as a shell reports a
process the signal killed (130 Ctrl-C/SIGINT, 141 a closed output pipe/SIGPIPE, 143 SIGTERM)."""


class Terminated(BaseException):
    """A termination signal (SIGTERM) arrived: raised by routetool's handler for it, so that the
    run unwinds like on Ctrl-C (temporary files removed, a capture's index finished). Ctrl-C's
    ``KeyboardInterrupt`` is turned into one with ``signum`` SIGINT once the run has unwound.

    A :class:`BaseException`, like :class:`KeyboardInterrupt`: the ``except Exception`` that
    catches a kernel's failures lets it through. ``signum``: the signal's number.
    """

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says that memory could not be allocated: ``MemoryError``, torch's
    ``OutOfMemoryError`` (CUDA), or the ``RuntimeError`` of torch's CPU allocator ("can't
    allocate memory"). An allocation the input forces is the input's problem (exit 2), never a
    kernel's crash or a traceback."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text.lower())


def install_extra(extra: str) -> str:
    """The fix for a missing optional extra (``plot``, ``capture``), for an install from the
    package index and for the README's install from a source checkout (a bare
    ``routetool[plot]`` in a checkout would send pip to the index), quoted for every shell."""
    return f"pip install 'routetool[{extra}]', or from a source checkout pip install -e '.[{extra}]'"


class RouteToolError(Exception):
    """A problem with the user's input or environment, reported in one line with exit 2.

    The message names the file (and tensor, where there is one), what is wrong, and the fix.
    It is one line of printable text: characters that are not printable (a newline or an ANSI
    escape in a file name, a NUL in a kernel's error text) are written as their Python escapes
    (:func:`printable`), so that the message names the file as it is and cannot rewrite the
    terminal. ``path`` and ``tensor`` keep the raw values.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, path: object = None, tensor: str | None = None, fix: str | None = None):
        parts = []
        if path is not None:
            parts.append(str(path))
        if tensor is not None:
            parts.append(tensor)
        parts.append(message)
        text = ": ".join(parts)
        if fix:
            text += f" ({fix})"
        super().__init__(printable(text))
        self.path = path
        self.tensor = tensor
        self.fix = fix

    def __reduce__(self):
        """Pickled as its text and attributes, so that it can travel between processes (torchrun)."""
        return _restore, (type(self), str(self), dict(self.__dict__))


class KernelError(RouteToolError):
    """The kernel under test crashed, wrote into its inputs, or returned outputs of the wrong shape,
    dtype or device.

    Reported in one line like bad input, but with exit code 1: the check found a problem
    with the kernel, not with the user's input. ``failure_class`` is one of validate's classes:
    ``crash``, ``modified_input``, ``wrong_shape``, ``wrong_dtype``, ``wrong_device``,
    ``rejected_undocumented`` (a rejection of an input the kernel does not document as
    unsupported).
    """

    exit_code = EXIT_FINDINGS

    def __init__(self, message: str, *, failure_class: str, **kw):
        super().__init__(message, **kw)
        self.failure_class = failure_class


class KernelRejection(RouteToolError):
    """The kernel under test refused an input that its docstring names as unsupported (the seed
    kernel and bfloat16 logits): a documented restriction, reported like bad input (exit 2) by
    replay, where the fix is another kernel or another trace. ``routetool validate`` fails the
    trace's case with ``failure_class`` (``rejected_documented``): a kernel that cannot route
    production input must not pass validation.
    """

    failure_class = "rejected_documented"


def _restore(cls: type, text: str, state: dict) -> RouteToolError:
    err = Exception.__new__(cls)
    Exception.__init__(err, text)
    err.__dict__.update(state)
    return err


def printable(text: str) -> str:
    """``text`` with every character that is not printable written as its Python escape.

    Control characters (``\\x00``, the ESC of an ANSI sequence ``\\x1b[31m``, tabs), lone
    surrogates (``\\udc80``, from bytes decoded with ``surrogateescape``) and other
    non-printable code points (:meth:`str.isprintable`) become the text :func:`repr` shows
    for them, so that text from a user's kernel can neither rewrite the terminal nor break
    an output file. Printable text, non-ASCII letters included, is unchanged.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def first_line(exc: BaseException, limit: int = 300, *, with_type: bool = True) -> str:
    """One line describing ``exc``: its first non-empty line, shortened to ``limit`` characters.

    Exceptions that the Triton interpreter wraps (``InterpreterError``, nested once per
    interpreted call, each holding the ``repr`` of the one inside) are unwrapped to the
    original exception. ``with_type``: prefix the exception's class name. Characters that
    are not printable (control characters, ANSI escapes, lone surrogates) are shown escaped
    (:func:`printable`): the text comes from a kernel under test and goes to a terminal.
    """
    seen = set()
    while type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else ""
    if with_type:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
