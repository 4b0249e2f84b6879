"""The validate report: verdicts by family, the failing cases with their first offending rows on
one screen; its JSON and JUnit documents (docs/validate.md)."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.panel import Panel
from rich.text import Text

from routetool.engine.verdict import Verdict
from routetool.errors import printable
from routetool.report.formats import xml_safe
from routetool.report.partial import partial_json, render_partial
from routetool.report.tables import Console, _count, _values, _weights, table, user_text

if TYPE_CHECKING:  # the types of the results rendered here; importing them would import torch
    pass


# ---------------------------------------------------------------------------------------
# validate
VALIDATE_SCHEMA = "routetool.validate/1"


def _same_float(a: float, b: float) -> bool:
    """The same float32 value, ``-0.0`` and ``0.0`` apart, NaN equal to NaN."""
    return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))


_MAX_SLOTS = 10
"""Slots of a row shown in the terminal; a wider row shows the 10 from two before its first difference."""


def _first_row_lines(case) -> list[Text]:
    """A failing case on a few lines: its classes; its first offending row and what its two outputs
    are; both outputs, ids and weights, as replay shows a failing row (where only the weights
    differ, the second line names the slot that differs most, in full float32 precision)."""
    head = Text.assemble(("✗ ", "bold red"), user_text(case.name), "  ", (", ".join(case.failure_classes), "red"))
    if not case.rows:
        return [head, Text.assemble("    ", user_text(case.message))]
    r = case.rows[0]
    padded = " (padded)" if r.is_padding else ""
    if r.failure_class == "batch_variant":
        labels = [f"B={n}" for n in r.batch_sizes]
        what = (f"token {r.row}{padded}: in a batch of {r.batch_sizes[0]} (row {r.positions[0]}) and of "
                f"{r.batch_sizes[1]} (row {r.positions[1]})")
    elif r.failure_class == "nondeterministic":
        labels = ["call 1", "call 2"]
        where = f" of a batch of {r.batch_sizes[0]}" if r.batch_sizes else ""
        what = f"row {r.row}{where}{padded}: two calls on the same input"
    else:
        labels = ["expected", "got"]
        what = f"row {r.row}{padded}: {r.failure_class}"
    k = max(len(r.expected_ids), len(r.got_ids))
    first = next((j for j in range(k) if j >= min(len(r.expected_ids), len(r.got_ids))
                  or r.expected_ids[j] != r.got_ids[j]
                  or not _same_float(r.expected_weights[j], r.got_weights[j])), 0)
    start = max(0, min(first - 2, k - _MAX_SLOTS))

    def window(values: list, show) -> str:
        cut = values[start:start + _MAX_SLOTS]
        return ("… " if start else "") + show(cut) + (" …" if start + _MAX_SLOTS < len(values) else "")

    width = max(map(len, labels))
    lines = [head, Text(f"    {what}")]
    sides = ((r.expected_ids, r.expected_weights), (r.got_ids, r.got_weights))
    for n, (label, (ids, weights)) in enumerate(zip(labels, sides)):
        if n == 1 and r.got_ids == r.expected_ids and len(r.got_weights) == len(r.expected_weights):
            diffs = [abs(x - y) if x == x and y == y else math.inf for x, y in zip(r.expected_weights, weights)]
            j = max(range(len(diffs)), key=diffs.__getitem__)
            lines.append(Text(f"    {label:<{width}} ids the same; w of slot {j} (expert {ids[j]}) {weights[j]:.9g}, "
                              f"not {r.expected_weights[j]:.9g}", style="red"))
        else:
            lines.append(Text(f"    {label:<{width}} ids {window(ids, _values)}; w {window(weights, _weights)}"))
    return lines


def _verdict_line(result, console: Console) -> None:
    """The verdict (decided by ``result.verdict``) with the counts behind it: passed, skipped (with
    the most common reason), rejected, failed."""
    n = len(result.cases)
    failed = sum(c.verdict == "fail" for c in result.cases)
    passed = sum(c.verdict in ("pass", "pass_tie") for c in result.cases)
    skipped = [c for c in result.cases if c.verdict == "skipped"]
    rejected = sum(c.verdict == "rejected" for c in result.cases)
    ties = [c for c in result.cases if c.verdict == "pass_tie"]
    parts = [f"{passed} of {n} cases passed" + (f" ({len(ties)} only within ties: {sum(c.tie_rows for c in ties):,} "
                                                "rows differ from the reference inside a tie)" if ties else "")]
    if skipped:
        reasons: dict[str, int] = {}
        for c in skipped:
            reasons[c.message] = reasons.get(c.message, 0) + 1
        top = max(reasons, key=reasons.get)
        parts.append(f"{len(skipped)} skipped ({top}" + (f", and {len(reasons) - 1} other reasons" if len(reasons) > 1
                                                          else "") + ")")
    if rejected:
        parts.append(f"{rejected} rejected as documented")
    if result.verdict is Verdict.NOTHING_CHECKED:
        what = "skipped" if all(c.verdict == "skipped" for c in result.cases) else "skipped or rejected"
        cases = f"all {n} cases were" if n != 1 else "the one case was"
        console.print(user_text(f"NOTHING CHECKED: {cases} {what}" + (f"; {parts[1]}" if skipped else ""),
                                style="bold yellow"))
    elif result.verdict is Verdict.PASS:
        console.print(user_text(f"PASS: {', '.join(parts)}; nothing failed", style="bold green"))
    else:
        console.print(user_text(f"FAIL: {failed} of {n} cases failed; exit code {result.exit_code} ("
                                + ", ".join(parts) + ")", style="bold red"))


def render_validate(result, console: Console, show_failures: int = 5, details: bool = False) -> None:
    """Print the verdict with its counts, validate's verdicts grouped by family, then the failing
    cases: up to ``show_failures`` of them (the first of each failure class first), each with its
    classes, its first offending row and both outputs with their weights, so that the answer fits
    one screen; the JSON holds every case and row. ``details``: also every case on a line (its
    family, name, verdict and message) and every failing case in full."""
    if details:
        show_failures = len(result.cases)
    render_partial(result.partial, console)  # (before anything: a verdict on part of a recording)
    ex = result.execution
    processes = f"; {result.world_size} processes (torchrun)" if result.world_size > 1 else ""
    console.print(Panel(user_text(f"kernel {result.kernel} on {ex.device_name}; suite {result.suite or 'none'}; "
                                  f"ties within {result.tie_ulps:g} float32 ulps{processes}"),
                        title="routetool validate", expand=False))
    _verdict_line(result, console)
    tbl = table("Verdicts by family", ["family", "cases", "pass", "pass (ties)", "tie rows", "rejected",
                                          "skipped", "fail"], left=("family",))
    families = result.families()
    tbl.columns[0].no_wrap = True  # family names whole, even at 80 columns
    tbl.columns[0].min_width = max((len(printable(f)) for f in families), default=6)
    for family, counts in families.items():
        total = sum(counts[v] for v in ("pass", "pass_tie", "rejected", "fail", "skipped"))
        tbl.add_row(user_text(family), str(total), _count(counts["pass"]), _count(counts["pass_tie"]),
                      _count(counts["tie_rows"]), _count(counts["rejected"]), _count(counts["skipped"]),
                      _count(counts["fail"], bad=True))
    console.print(tbl)
    rejected = [c for c in result.cases if c.verdict == "rejected"]
    if rejected:
        first = rejected[0]
        console.print(user_text(f"{len(rejected)} documented rejection(s), e.g. {first.name}: {first.message}",
                                style="dim"))
    failed = [c for c in result.cases if c.verdict == "fail"]
    if failed:
        chosen: list = []
        for c in failed:  # the first case of each class, then the next ones
            if any(cls not in {x for d in chosen for x in d.failure_classes} for cls in c.failure_classes):
                chosen.append(c)
        chosen = chosen[:show_failures]
        chosen += [c for c in failed if c not in chosen][:show_failures - len(chosen)]
        shown = [c for c in failed if c in chosen]
        by_class: dict[str, int] = {}
        for c in failed:
            for cls in c.failure_classes:
                by_class[cls] = by_class.get(cls, 0) + 1
        console.print(Text.assemble((f"Failing cases ({len(failed)}" + (f"; {len(shown)} shown" if len(shown) <
                                     len(failed) else "") + "): ", "bold"),
                                    (", ".join(f"{cls} {n}" for cls, n in by_class.items()), "red")))
        for c in shown:
            for line in _first_row_lines(c):
                console.print(line, overflow="fold")
        if len(shown) < len(failed):
            console.print(Text(f"  and {len(failed) - len(shown)} more failing cases: --details shows each, --json "
                               "lists every case and its offending rows", style="dim"))
    if details:
        every = table("Every case", ["case", "verdict", "message"], left=("case", "verdict", "message"))
        for c in result.cases:
            every.add_row(user_text(c.name), c.verdict, user_text(c.message or "-"))
        console.print(every)
    else:
        console.print(Text("--details: every case with its verdict and message, every failing case; --json, --junit "
                           "for all of it", style="dim"))


def _row_line(r) -> str:
    """An offending row on one plain line (JUnit): where, its class, both outputs with weights."""
    where = (f" (batches of {r.batch_sizes[0]} and {r.batch_sizes[1]}, rows {r.positions[0]} and {r.positions[1]})"
             if r.batch_sizes else "")
    return (f"row {r.row}{where} [{r.failure_class}]: expected {r.expected_ids} weights "
            f"{[float(f'{w:.9g}') for w in r.expected_weights]} got {r.got_ids} weights "
            f"{[float(f'{w:.9g}') for w in r.got_weights]}")


def _row_json(row) -> dict:
    """An offending row; ``batch_sizes`` and ``positions`` only on rows that have them (docs/validate.md)."""
    return {k: v for k, v in asdict(row).items() if v is not None or k not in ("batch_sizes", "positions")}


def validate_json(result) -> dict:
    """The validate result as a JSON document (docs/validate.md)."""
    import torch
    import triton

    return {
        "schema": VALIDATE_SCHEMA,
        **partial_json(result.partial),
        "kernel": result.kernel,
        "suite": result.suite,
        "execution": {"device": str(result.execution.device), "device_name": result.execution.device_name,
                      "interpreted": result.execution.interpreted, "torch_version": torch.__version__,
                      "triton_version": triton.__version__},
        "tie_tolerance_ulps": result.tie_ulps,
        "verdict": result.verdict.value,
        "exit_code": result.exit_code,
        "world_size": result.world_size,
        "families": result.families(),
        "cases": [
            {
                "family": c.family, "name": c.name, "description": c.description, "verdict": c.verdict,
                "tie_rows": c.tie_rows, "failure_classes": c.failure_classes, "message": c.message,
                "duration_s": c.duration_s, "rows": [_row_json(r) for r in c.rows],
            }
            for c in result.cases
        ],
    }


def validate_junit(result) -> str:
    """The validate result as JUnit XML (one testsuite per family, one testcase per case).

    Characters XML 1.0 cannot hold (in a kernel's message, a trace's file name) are written
    as their Python escapes (:func:`xml_safe`): the document always parses.
    """
    import xml.etree.ElementTree as ET

    root = ET.Element("testsuites", name=f"routetool validate {result.kernel}")
    by_family: dict[str, list] = {}
    for c in result.cases:
        by_family.setdefault(c.family, []).append(c)
    for family, cases in by_family.items():
        suite = ET.SubElement(root, "testsuite", name=family, tests=str(len(cases)),
                              failures=str(sum(c.verdict == "fail" for c in cases)),
                              skipped=str(sum(c.verdict == "skipped" for c in cases)),
                              time=f"{sum(c.duration_s for c in cases):.3f}")
        for c in cases:
            tc = ET.SubElement(suite, "testcase", classname=family, name=c.name, time=f"{c.duration_s:.3f}")
            if c.verdict == "fail":
                failure = ET.SubElement(tc, "failure", message=c.message[:500], type=",".join(c.failure_classes))
                failure.text = "\n".join(_row_line(r) for r in c.rows) or c.message
            elif c.verdict == "skipped":
                ET.SubElement(tc, "skipped", message=c.message)
            elif c.message:
                ET.SubElement(tc, "system-out").text = c.message
    ET.indent(root)
    # ElementTree writes such characters as they are; they never occur in its markup, only in
    # text and attribute values, so replacing them in the serialised document is safe
    return xml_safe(ET.tostring(root, encoding="unicode", xml_declaration=True)) + "\n"




class ValidateReport:
    """validate's report (:class:`routetool.report.protocol.Report`), with its JUnit XML face."""

    def __init__(self, result) -> None:
        self.result = result

    @property
    def exit_code(self) -> int:
        return self.result.exit_code

    def terminal(self, console: Console, details: bool = False) -> None:
        render_validate(self.result, console, details=details)

    def document(self) -> dict:
        return validate_json(self.result)

    def junit(self) -> str:
        return validate_junit(self.result)
