"""The one error type for user-facing failures, and the exit codes routetool documents."""

from __future__ import annotations

EXIT_OK = 0
"""Everything checked passed."""
EXIT_FINDINGS = 1
"""The check ran and found problems (real mismatches, invalid outputs, failed cases)."""
EXIT_USAGE = 2
"""Bad usage or bad input (unreadable trace, wrong tensor, impossible parameter)."""


class RouteToolError(Exception):
    """A problem with the user's input or environment, reported in one line with exit 2.

    The message names the file (and tensor, where there is one), what is wrong, and the fix.
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
        super().__init__(text)
        self.path = path
        self.tensor = tensor
        self.fix = fix


class KernelError(RouteToolError):
    """The kernel under test crashed or returned outputs of the wrong shape or dtype.

    Reported in one line like bad input, but with exit code 1: the check found a problem
    with the kernel, not with the user's input. ``failure_class`` is ``crash`` or
    ``wrong_shape`` (validate's classes).
    """

    exit_code = EXIT_FINDINGS

    def __init__(self, message: str, *, failure_class: str, **kw):
        super().__init__(message, **kw)
        self.failure_class = failure_class
