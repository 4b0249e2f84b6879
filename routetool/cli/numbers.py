"""click parameter types for numeric options, read through :mod:`routetool.numtext`.

click's ``INT``, ``FLOAT``, ``IntRange`` and ``FloatRange`` convert text with Python's
``int()``/``float()``, which read Arabic-Indic or fullwidth digits (``--affinity ١`` was 1),
underscores (``--ties 1_0`` was 10) and surrounding whitespace. These types refuse such text
with a message naming the plain spelling, and otherwise behave as click's own: the same
ranges, clamping, metavars, ``--help`` text and messages for text that is no number at all.
Every numeric option of the command line uses them::

    @click.option("--ties", type=IntRange(0, 100_000), default=4, show_default=True)
"""

from __future__ import annotations

import click

from routetool.numtext import number_problem


class _Plain:
    """Mixin: refuse text that only Python's loose ``int()``/``float()`` reads, then convert as click does."""

    integer = False

    def convert(self, value, param, ctx):
        problem = number_problem(value, integer=self.integer) if isinstance(value, str) else ""
        if problem:
            self.fail(problem, param, ctx)
        return super().convert(value, param, ctx)


class PlainInt(_Plain, click.types.IntParamType):
    """click's ``INT`` for plain decimal integers (``-12``, ``+3``, ``007``)."""

    integer = True


class PlainFloat(_Plain, click.types.FloatParamType):
    """click's ``FLOAT`` for plain decimal numbers (``2.5``, ``-1e-20``, ``.5``, ``nan``, ``inf``)."""


class IntRange(_Plain, click.IntRange):
    """click's ``IntRange`` for plain decimal integers."""

    integer = True


class FloatRange(_Plain, click.FloatRange):
    """click's ``FloatRange`` for plain decimal numbers."""


INT = PlainInt()
FLOAT = PlainFloat()
