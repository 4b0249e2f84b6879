"""The notice every report gives first when its input holds less than a whole recording.

A sharded trace whose recording did not finish (its index is not ``"complete": true``: killed,
stopped on an error, still recording) or whose layers hold unequal steps (a step cut short
inside the model) is read as it is, but ``replay``, ``validate``, ``balance`` and ``info`` say so
before anything else, in the terminal and in the JSON (``"complete": false`` and the steps
present), so that a verdict on part of a recording is never read as one on the whole
(docs/cli-contract.md, "Partial traces").
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console

from routetool.report.tables import layer_list, user_text

MAX_LINES = 8
"""Partial traces named one a line; the rest are counted."""


def partial_lines(partial: Sequence) -> list[str]:
    """One line per partial trace (:class:`~routetool.io.run.PartialTrace`), at most
    :data:`MAX_LINES` and a count of the rest: ``INCOMPLETE TRACE: run.json: the recording did not
    finish (...); steps present: 10 steps (layers 0-2); the report covers these steps only``."""
    lines = []
    for p in partial[:MAX_LINES]:
        who = f"rank-{p.rank} " if p.rank is not None else ""
        lines.append(f"INCOMPLETE TRACE: {who}{p.trace}: {p.why()}; steps present: {steps_text(p.steps)}; "
                     "the report covers these steps only")
    if len(partial) > MAX_LINES:
        lines.append(f"INCOMPLETE TRACE: {len(partial) - MAX_LINES} more ranks (see the JSON's \"partial\")")
    return lines


def steps_text(steps: dict[int, int]) -> str:
    """The steps present, the layers of one count grouped, most first: ``10 steps (layers 0-1),
    9 (layer 2)``."""
    by_count: dict[int, list[int]] = {}
    for layer, n in sorted(steps.items()):
        by_count.setdefault(n, []).append(layer)
    parts = []
    for i, (n, layers) in enumerate(sorted(by_count.items(), key=lambda kv: -kv[0])):
        where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layer_list(layers)}"
        parts.append(f"{n:,}{' steps' if i == 0 else ''} ({where})")
    return ", ".join(parts)


def render_partial(partial: Sequence, console: Console) -> None:
    """Print :func:`partial_lines`, before anything else of a report (nothing when ``partial`` is
    empty), each on one line however narrow the terminal (it wraps them, not rich: a log keeps
    each notice on one line)."""
    for line in partial_lines(partial):
        console.print(user_text(line, style="bold yellow"), soft_wrap=True)


def partial_json(partial: Sequence) -> dict:
    """``{"complete": bool, "partial": [each trace's facts]}`` for a report's JSON document:
    ``complete`` is false when any trace read is partial."""
    return {"complete": not partial, "partial": [p.to_json() for p in partial]}
