"""The verdict a command's result carries, decided once in the result: the terminal, ``--json``
and ``--junit`` only show it.

* ``PASS``: something was checked and nothing failed (exit 0);
* ``FAIL``: a check found a problem (exit 1);
* ``NOTHING CHECKED``: the run had nothing to check (an ids-only trace replayed, only skipped
  validate cases): exit 0, but a CI job reading the JSON must not read it as a pass.

In JSON the verdict is written as ``"pass"``, ``"fail"`` or ``"nothing_checked"``, beside
``"exit_code"``.
"""

from __future__ import annotations

from enum import Enum

from routetool.errors import EXIT_FINDINGS, EXIT_OK


class Verdict(str, Enum):
    """A run's verdict (see the module docstring); the value is its JSON spelling."""

    PASS = "pass"
    FAIL = "fail"
    NOTHING_CHECKED = "nothing_checked"

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self is Verdict.FAIL else EXIT_OK

    @property
    def label(self) -> str:
        """How the terminal writes it: ``PASS``, ``FAIL``, ``NOTHING CHECKED``."""
        return self.value.replace("_", " ").upper()

    @classmethod
    def of(cls, *, checked: int, failed: bool) -> Verdict:
        """FAIL when anything failed, else PASS when ``checked`` > 0, else NOTHING CHECKED."""
        if failed:
            return cls.FAIL
        return cls.PASS if checked else cls.NOTHING_CHECKED
