"""What several commands' option handling shares: the progress bar, finite-number and integer-list
options."""

from __future__ import annotations

import click
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)

from routetool.engine.execution import SEED_SIGNATURE
from routetool.errors import RouteToolError
from routetool.numtext import list_items, parse_int, refuse_repeats
from routetool.report.tables import Console


KERNEL_SIGNATURE_HELP = (f"A module:function kernel takes the seed's signature, {SEED_SIGNATURE}: the logits and "
                         "the bias by position, the rest by keyword.")
"""Appended to every command's ``--kernel`` help: the signature a ``module:function`` must take."""


def _progress(enabled: bool, percent: bool = False) -> Progress:
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


def _finite(ctx, param, value):
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not nan")
    return value


def _int_list(text: str, name: str) -> list[int]:
    values = [parse_int(v) for v in list_items(name, text, "1,64,4096")]
    if any(v is None for v in values):
        raise RouteToolError(f"{name} {text!r} is not a comma-separated list of integers", fix="e.g. 1,64,4096")
    if any(v < 1 for v in values):
        raise RouteToolError(f"{name} {text!r} needs positive integers", fix="e.g. 1,64,4096")
    return refuse_repeats(name, text, values)


