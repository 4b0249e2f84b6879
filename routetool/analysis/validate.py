"""``routetool validate``: run a routing kernel on the edge-case suite and on traces, judge each case.

Each case ends in one verdict:

* ``pass``; ``pass_tie``: passed, with rows that differ from the reference only inside a tie
  (their count is reported);
* ``fail``: with the failure classes, the first offending rows, their inputs and both outputs;
* ``rejected``: the kernel raised ValueError/TypeError/NotImplementedError on a suite case's
  unusual input. It counts as a pass only when the kernel documents the restriction: its
  docstring names the case's unusual feature (e.g. ``bfloat16``, ``int64``,
  ``non-contiguous``); any other exception, or a rejection of an input the kernel does not
  document as unsupported, is a failure (``rejected_undocumented``). A trace is production
  input: a kernel that rejects any step of a trace's layer fails that case, whether it
  documents the rejection (``rejected_documented``, e.g. the seed and bf16 logits) or not
  (``rejected_undocumented``);
* ``skipped``: the case needs a GPU (large sizes, CUDA graphs), or a trace's layer holds
  nothing to route (no logits, an ids-only trace; or no token rows).

Checks on every output (failure class in brackets): shapes and dtypes [wrong_shape, wrong_dtype];
the device of the inputs [wrong_device];
results in the caller's buffers [output_not_in_buffers] and nothing written outside the
``[num_tokens, topk]`` view [wrote_outside_view]; the tie-aware comparison with the reference
[mismatch, invalid:<reason>, weight_error]; weights equal to the unbiased scores of the chosen
experts, renormalised [weights_not_renormalized_unbiased]; without eps, each row's weights sum
to route_scale [weight_sum]. Extra checks of some cases: the same input routed again gives
bit-identical ids and weights [nondeterministic]; each token's ids and weights are bit-identical
in batches of other sizes, at other positions, with padded rows around it [batch_variant];
outputs independent of the order of unrelated rows [row_order_dependence]; a changed padding
mask and bias change the output, in eager calls and through a captured CUDA graph
[stale_output]. A kernel found nondeterministic is not judged for batch_variant or
row_order_dependence: two calls already differ on one input; and before a difference between
two batches or two row orders is named batch_variant or row_order_dependence, each of the two
inputs is routed again (up to ``REPEATS`` times) and must give its bits again, else it is
nondeterministic (a kernel that breaks ties by chance agrees with itself now and then).
"""

from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from routetool.engine.compare import INVALID_REASONS, RowClass, compare_step, weight_tolerance
from routetool.engine.distributed import Workers
from routetool.engine.contract import (
    KERNEL_ID_DTYPES,
    KERNEL_WEIGHT_DTYPE,
    KernelOutcome,
    RoutingFn,
    rejection_documented,  # noqa: F401 - part of validate's interface (the documented-rejection rule)
)
from routetool.engine.router import Router
from routetool.engine.stream import stream_layer
from routetool.engine.verdict import Verdict
from routetool.errors import EXIT_FINDINGS, EXIT_USAGE, RouteToolError, first_line
from routetool.engine.execution import Execution
from routetool.analysis.suite import Case, CaseInput, batch_around

VERDICTS = ("pass", "pass_tie", "rejected", "fail", "skipped")


@dataclass
class RowReport:
    """One offending row: where, why, the inputs that matter, and both outputs.

    ``expected_*`` is the reference's output and ``got_*`` the kernel's, except for the classes
    that compare the kernel with itself: for ``nondeterministic``, the first and the second call
    on one input; for ``batch_variant``, the token in the case's own batch and in another one.
    Rows of a batch other than the case's own carry ``batch_sizes`` and ``positions``: the
    sizes of the two batches whose outputs are shown and the row's position in each (``row`` is
    the first position); they are ``None`` otherwise.
    """

    row: int
    failure_class: str
    is_padding: bool
    top_inputs: list[dict]
    expected_ids: list[int]
    got_ids: list[int]
    expected_weights: list[float]
    got_weights: list[float]
    batch_sizes: list[int] | None = None
    positions: list[int] | None = None


@dataclass
class CaseResult:
    """Verdict of one case (see the module docstring)."""

    family: str
    name: str
    description: str
    verdict: str
    tie_rows: int = 0
    failure_classes: list[str] = field(default_factory=list)
    message: str = ""
    rows: list[RowReport] = field(default_factory=list)
    duration_s: float = 0.0
    exit_code: int = 0

    def __post_init__(self):
        if self.verdict == "fail" and not self.exit_code:
            self.exit_code = EXIT_FINDINGS

    @property
    def ok(self) -> bool:
        return self.verdict in ("pass", "pass_tie", "rejected", "skipped")


@dataclass
class ValidateResult:
    """All verdicts of one ``routetool validate`` run."""

    kernel: str
    execution: Execution
    suite: str | None
    tie_ulps: float
    cases: list[CaseResult]
    world_size: int = 1
    """The processes the cases ran on (torchrun; 1 alone)."""
    partial: list = field(default_factory=list)
    """The traces read that hold less than a whole recording (:class:`routetool.io.run.PartialTrace`)."""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases)

    @property
    def verdict(self) -> Verdict:
        """FAIL when a case failed; NOTHING CHECKED when no case passed (all skipped or rejected); else PASS."""
        return Verdict.of(checked=sum(c.verdict in ("pass", "pass_tie") for c in self.cases), failed=not self.ok)

    @property
    def exit_code(self) -> int:
        """The verdict's exit code; 2 (bad usage) when every failure is a trace the kernel documents it
        cannot route (``rejected_documented``), as replay and balance exit on it."""
        codes = {c.exit_code for c in self.cases if c.verdict == "fail"}
        return EXIT_USAGE if codes == {EXIT_USAGE} else self.verdict.exit_code

    def families(self) -> dict[str, dict[str, int]]:
        """Family -> verdict counts (plus ``tie_rows``), in first-seen order."""
        out: dict[str, dict[str, int]] = {}
        for c in self.cases:
            counts = out.setdefault(c.family, {v: 0 for v in VERDICTS} | {"tie_rows": 0})
            counts[c.verdict] += 1
            counts["tie_rows"] += c.tie_rows
        return out


class CallFailed(Exception):
    """A kernel call that broke the contract (:mod:`routetool.engine.contract`), with its outcome."""

    def __init__(self, outcome: KernelOutcome):
        super().__init__(outcome.detail)
        self.outcome = outcome


def _call(fn: RoutingFn, inp: CaseInput, check_inputs: bool = True, feature: str | None = None):
    """``fn`` on the case's inputs, judged by the one kernel contract; a broken contract raises
    :class:`CallFailed`. ``check_inputs=False`` inside a CUDA-graph capture (the check synchronises).
    ``feature``: the case's unusual input; a router beyond the seed's semantics is named by what it
    asks first (``n_group``, ``sqrtsoftplus``...: a kernel's rejection is documented when its
    docstring names that)."""
    beyond = inp.router.beyond_seed()
    out = Router(inp.router, fn).call(inp.gating_output, inp.bias, is_padding=inp.is_padding,
                                      topk_weights=inp.topk_weights, topk_ids=inp.topk_ids,
                                      feature=beyond[0] if beyond else feature or "",
                                      check_inputs=check_inputs)
    if not out.ok:
        raise CallFailed(out)
    return out.weights, out.ids


def _top_inputs(inp: CaseInput, scores: torch.Tensor, biased: torch.Tensor, row: int) -> list[dict]:
    k = min(inp.topk + 2, biased.shape[1])
    order = torch.sort(biased[row], descending=True, stable=True).indices[:k].tolist()
    g = inp.gating_output[row].float()
    return [{"expert": e, "logit": float(g[e]), "score": float(scores[row, e]), "biased_score": float(biased[row, e])}
            for e in order]


def evaluate(inp: CaseInput, weights: torch.Tensor, ids: torch.Tensor, *, tie_ulps: float,
             max_rows: int = 3, first_rows: bool = False):
    """Judge one output against the reference and the invariants.

    Returns:
        ``(failure_classes, tie_equivalent_rows, offending_rows)``, and with ``first_rows`` a
        fourth item: failure class -> the first row it applies to.
    """
    from routetool_kernels.reference import pick_weights, weight_sum

    T, K = inp.gating_output.shape[0], inp.topk
    if tuple(weights.shape) != (T, K) or tuple(ids.shape) != (T, K):
        return ["wrong_shape"], 0, []
    if weights.dtype != KERNEL_WEIGHT_DTYPE or ids.dtype not in KERNEL_ID_DTYPES:
        return ["wrong_dtype"], 0, []
    device = inp.gating_output.device
    if weights.device != device or ids.device != device:
        return ["wrong_device"], 0, []
    ref_w, ref_ids, scores, biased = inp.reference()
    tol = weight_tolerance(torch.float32, inp.router.route_scale)
    cmp = compare_step(ids, weights, ref_ids, ref_w, scores, biased, inp.is_padding, tie_ulps=tie_ulps, tolerance=tol)

    classes: list[str] = []
    bad_rows: dict[int, str] = {}
    first: dict[str, int] = {}

    def flag(name: str, rows: torch.Tensor) -> None:
        idx = torch.nonzero(rows).flatten().tolist()
        if idx:
            classes.append(name)
            first.setdefault(name, idx[0])
            for r in idx[:max_rows]:
                bad_rows.setdefault(r, name)

    flag("mismatch", cmp.row_class == RowClass.MISMATCH)
    for i, reason in enumerate(INVALID_REASONS):
        flag(f"invalid:{reason}", cmp.invalid_mask[:, i])
    flag("weight_error", cmp.weight_over_tol & (cmp.row_class != RowClass.INVALID))

    # Invariants on the kernel's own picks (valid, unpadded rows).
    pad = inp.is_padding if inp.is_padding is not None else torch.zeros(T, dtype=torch.bool, device=device)
    valid = ~pad & (cmp.row_class != RowClass.INVALID)
    expected = pick_weights(scores, ids, inp.router)
    w = weights.float()
    off = (w - expected).abs() > tol.atol + tol.rtol * expected.abs()
    flag("weights_not_renormalized_unbiased", valid & off.any(-1))
    total = weight_sum(inp.router)
    if total is not None:
        sums = w.sum(-1)
        nonzero = expected.sum(-1) > 0  # some picked score is > 0
        flag("weight_sum", valid & nonzero & ((sums - total).abs() > 1e-5 * total * max(1, K / 8)))

    reports = []
    for r, name in sorted(bad_rows.items())[:max_rows]:
        reports.append(RowReport(
            row=r, failure_class=name, is_padding=bool(pad[r]), top_inputs=_top_inputs(inp, scores, biased, r),
            expected_ids=ref_ids[r].tolist(), got_ids=ids[r].tolist(),
            expected_weights=[float(x) for x in ref_w[r]], got_weights=[float(x) for x in w[r]],
        ))
    tie_rows = int((cmp.row_class == RowClass.TIE_EQUIVALENT).sum())
    if first_rows:
        return list(dict.fromkeys(classes)), tie_rows, reports, first
    return list(dict.fromkeys(classes)), tie_rows, reports


def _poison(inp: CaseInput) -> None:
    if inp.topk_weights is not None:
        inp.topk_weights.fill_(-12345.0)
    if inp.topk_ids is not None:
        inp.topk_ids.fill_(-12345)


def _buffer_checks(inp: CaseInput, weights: torch.Tensor, ids: torch.Tensor) -> list[str]:
    classes = []
    T, K = inp.gating_output.shape[0], inp.topk
    for buf, out, sentinel in ((inp.topk_weights, weights, -12345.0), (inp.topk_ids, ids, -12345)):
        if buf is None:
            continue
        view = buf[:T, :K]
        if tuple(out.shape) != (T, K) or not torch.equal(view, out.to(view.dtype)):
            classes.append("output_not_in_buffers")
        outside = torch.ones_like(buf, dtype=torch.bool)
        outside[:T, :K] = False
        if (buf[outside] != sentinel).any():
            classes.append("wrote_outside_view")
    return list(dict.fromkeys(classes))


def _change_inputs(inp: CaseInput) -> None:
    """Pad every third row and push one expert to the top of every row, in place."""
    inp.is_padding[::3] = True
    inp.bias[inp.bias.shape[0] // 2] += 10.0


def _bits_differ(w1: torch.Tensor, ids1: torch.Tensor, w2: torch.Tensor, ids2: torch.Tensor) -> torch.Tensor:
    """``[rows]`` bool: the rows whose ids or float32 weights differ in any bit."""
    return (ids1.long() != ids2.long()).any(-1) | (w1.view(torch.int32) != w2.view(torch.int32)).any(-1)


def _self_comparison(cls: str, inp: CaseInput, first: tuple, second: tuple, r: int, p: int,
                     sizes: list[int] | None = None) -> RowReport:
    """A token's outputs from two calls of the kernel: row ``r`` of ``first`` (``(weights, ids)``
    of ``inp``) against row ``p`` of ``second``; ``sizes``: the two calls' batch sizes, when the
    second is another batch than ``inp``."""
    _, _, scores, biased = inp.reference()
    pad = inp.is_padding is not None and bool(inp.is_padding[r])
    return RowReport(row=r, failure_class=cls, is_padding=pad, top_inputs=_top_inputs(inp, scores, biased, r),
                     expected_ids=first[1][r].tolist(), got_ids=second[1][p].tolist(),
                     expected_weights=[float(x) for x in first[0][r]], got_weights=[float(x) for x in second[0][p]],
                     batch_sizes=sizes, positions=None if sizes is None else [r, p])


def _twice(fn: RoutingFn, inp: CaseInput, first: tuple, feature: str | None,
           size: int | None = None) -> list[RowReport]:
    """Route ``inp`` again; the rows (at most 3) that differ from ``first``, ``(weights, ids)``."""
    w2, ids2 = _call(fn, inp, feature=feature)
    changed = torch.nonzero(_bits_differ(*first, w2, ids2)).flatten().tolist()
    sizes = None if size is None else [size, size]
    return [_self_comparison("nondeterministic", inp, first, (w2, ids2), r, r, sizes) for r in changed[:3]]


REPEATS = 8
"""Calls of one input that must all give its first call's bits before a difference between two
inputs is put down to the difference of the inputs (:func:`_repeated`)."""


def _repeated(fn: RoutingFn, inp: CaseInput, first: tuple, feature: str | None) -> list[RowReport]:
    """Route ``inp`` up to :data:`REPEATS` more times; the rows that differ from ``first`` at the
    first call that differs (``nondeterministic``), or ``[]``."""
    for _ in range(REPEATS):
        changed = _twice(fn, inp, first, feature)
        if changed:
            return changed
    return []


def _batch_check(case: Case, fn: RoutingFn, inp: CaseInput, base: tuple) -> tuple[list[str], list[RowReport]]:
    """``"batch"``: each token of ``inp`` routed in a batch of each of the case's sizes
    (:func:`routetool.analysis.suite.batch_around`), compared bit for bit with ``base``, its
    ``(weights, ids)`` in the case's own batch; with ``"batch_determinism"`` the largest batch
    is routed twice (a GPU kernel's persistent grid and its atomics run there). At most one row
    per size, 3 in all."""
    T = inp.gating_output.shape[0]
    sizes = sorted(case.batch_sizes)
    outputs = {}
    for size in reversed(sizes):  # the largest first: two calls that differ end the check
        probe = batch_around(case.name, inp, size)
        w, ids = _call(fn, probe.inp, feature=case.feature)
        out = (w.clone(), ids.clone())  # (a kernel may return its own buffers, reused by the next call)
        if size == sizes[-1] and "batch_determinism" in case.checks:
            changed = _twice(fn, probe.inp, out, case.feature, size)
            if changed:
                return ["nondeterministic"], changed
        outputs[size] = (probe, out)
    rows = []
    for size in sizes:
        probe, out = outputs[size]
        r = torch.tensor(probe.rows, device=inp.gating_output.device)
        p = torch.tensor(probe.positions, device=inp.gating_output.device)
        differ = torch.nonzero(_bits_differ(base[0][r], base[1][r], out[0][p], out[1][p])).flatten().tolist()
        if differ:
            changed = _repeated(fn, inp, base, case.feature) or _repeated(fn, probe.inp, out, case.feature)
            if changed:  # not the batch: the kernel does not repeat itself on one input
                return ["nondeterministic"], changed
            j = differ[0]
            rows.append(_self_comparison("batch_variant", inp, base, out, probe.rows[j], probe.positions[j],
                                         [T, size]))
    return (["batch_variant"] if rows else []), rows[:3]


def _run_checks(case: Case, fn: RoutingFn, inp: CaseInput, weights, ids, tie_ulps: float) -> tuple[list[str], int, list]:
    classes, ties, rows = evaluate(inp, weights, ids, tie_ulps=tie_ulps)
    classes += _buffer_checks(inp, weights, ids)
    base = (weights.clone(), ids.clone())  # later calls may write into the buffers the outputs are views of
    if "determinism" in case.checks:
        changed = _twice(fn, inp, base, case.feature)
        if changed:  # two calls on one input differ: batch and row-order comparisons would only see that
            return list(dict.fromkeys([*classes, "nondeterministic"])), ties, rows + changed
    if "batch" in case.checks:
        found, batch_rows = _batch_check(case, fn, inp, base)
        if "nondeterministic" in found:
            return list(dict.fromkeys([*classes, *found])), ties, rows + batch_rows
        classes += found
        rows += batch_rows
    if "row_order" in case.checks:
        n = inp.gating_output.shape[0]
        perm = (torch.arange(n, device=inp.gating_output.device) + 1) % n  # every row moves by one
        flipped = inp.with_rows(inp.gating_output[perm].contiguous(),
                                None if inp.is_padding is None else inp.is_padding[perm].contiguous())
        w2, ids2 = _call(fn, flipped)
        inverse = torch.argsort(perm)
        if not torch.equal(ids2[inverse].long().cpu(), base[1].long().cpu()) or not torch.allclose(
                w2[inverse].float().cpu(), base[0].float().cpu(), rtol=1e-6, atol=1e-7):
            # a difference is the rows' order only if each input routed again gives its bits again:
            # a kernel that breaks ties by chance may have agreed with itself once above
            changed = (_repeated(fn, inp, base, case.feature)
                       or _repeated(fn, flipped, (w2.clone(), ids2.clone()), case.feature))
            if changed:
                return list(dict.fromkeys([*classes, "nondeterministic"])), ties, rows + changed
            classes.append("row_order_dependence")
    if "mask_change" in case.checks:
        ref_before = _reference_ids(inp)
        _change_inputs(inp)
        w3, ids3 = _call(fn, inp)
        c3, t3, r3 = _after_change(inp, ref_before, base, (w3, ids3), tie_ulps)
        classes += c3
        rows += [r for r in r3 if all(r.row != q.row for q in rows)]
        ties += t3
    return list(dict.fromkeys(classes)), ties, rows


def _reference_ids(inp: CaseInput) -> torch.Tensor:
    """``[T, K]`` the reference's ids for ``inp`` as it is now (padded rows -1)."""
    return inp.reference()[1].clone()


def _after_change(inp: CaseInput, ref_before: torch.Tensor, first: tuple, second: tuple,
                  tie_ulps: float) -> tuple[list[str], int, list]:
    """Judge the output of a call made after :func:`_change_inputs` changed ``inp`` in place.

    ``stale_output`` only when the outputs did not change with their inputs: a row whose
    reference ids changed (newly padded, or the pushed expert now picked) kept the first call's
    output bit for bit (``first``/``second``: ``(weights, ids)`` of the calls before and after).
    Otherwise the second output is judged as any output (:func:`evaluate`), its own classes (a
    padding bug's ``invalid:bad_padding``...) reported under their own names.
    """
    classes, ties, rows = evaluate(inp, second[0], second[1], tie_ulps=tie_ulps)
    should_change = (_reference_ids(inp).long() != ref_before.long()).any(-1)
    kept = ~_bits_differ(first[0], first[1], second[0], second[1])
    if bool((should_change & kept).any()):
        return ["stale_output"], ties, rows
    return classes, ties, rows


def _run_graph_case(case: Case, fn: RoutingFn, inp: CaseInput, tie_ulps: float) -> tuple[list[str], int, list]:
    _call(fn, inp)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = _call(fn, inp, check_inputs=False)
    graph.replay()
    torch.cuda.synchronize()
    classes, ties, rows = evaluate(inp, weights, ids, tie_ulps=tie_ulps)
    first = (weights.clone(), ids.clone())
    ref_before = _reference_ids(inp)
    _change_inputs(inp)
    graph.replay()
    torch.cuda.synchronize()
    c2, t2, r2 = _after_change(inp, ref_before, first, (weights, ids), tie_ulps)
    classes += c2
    rows += [r for r in r2 if all(r.row != q.row for q in rows)]
    return list(dict.fromkeys(classes)), ties + t2, rows


def run_case(case: Case, fn: RoutingFn, execution: Execution, *, tie_ulps: float) -> CaseResult:
    """Run one suite case on ``fn`` and judge it."""
    start = time.perf_counter()
    res = CaseResult(family=case.family, name=case.name, description=case.description, verdict="pass")
    if case.cuda_only and execution.device.type != "cuda":
        res.verdict, res.message = "skipped", "needs a CUDA GPU"
        return res
    inp = case.build(execution.device)
    _poison(inp)
    try:
        if "cuda_graph" in case.checks:
            classes, ties, rows = _run_graph_case(case, fn, inp, tie_ulps)
        else:
            weights, ids = _call(fn, inp, feature=case.feature)
            classes, ties, rows = _run_checks(case, fn, inp, weights, ids, tie_ulps)
    except CallFailed as exc:
        outcome = exc.outcome
        if outcome.failure_class == "rejected_documented":  # a suite case's input: the tool made it
            res.verdict, res.message = "rejected", f"documented rejection of {case.feature}: {outcome.detail}"
        else:
            res.verdict, res.failure_classes = "fail", [outcome.failure_class]
            res.message = outcome.detail if outcome.failure_class in ("crash", "rejected_undocumented") \
                else outcome.message("the kernel")
            if outcome.failure_class == "rejected_undocumented" and case.feature:  # say which, as a documented one
                res.message = f"undocumented rejection of {case.feature}: {outcome.detail} ({outcome.fix})"
        res.duration_s = time.perf_counter() - start
        return res
    except Exception as exc:  # noqa: BLE001 - a crash of the kernel under test in a check's own code
        res.verdict, res.failure_classes = "fail", ["crash"]
        res.message = first_line(exc)
        res.duration_s = time.perf_counter() - start
        return res
    res.failure_classes, res.tie_rows, res.rows = classes, ties, rows
    if classes:
        res.verdict = "fail"
        res.message = ", ".join(classes)
    elif ties:
        res.verdict = "pass_tie"
        res.message = f"{ties} tie-equivalent rows"
    res.duration_s = time.perf_counter() - start
    return res


def validate_layer(trace, layer: int, family: str, fn: RoutingFn, kernel_name: str, execution: Execution, *,
                   tie_ulps: float) -> CaseResult:
    """The case of one layer of a trace: the kernel on every captured step, each output judged as a
    suite case's is (:func:`evaluate`: the reference, the invalid-row reasons, padding, and the
    weights against the kernel's own picks, tie-equivalent rows included).

    ``trace``: an open trace; ``family``: the case's family (``trace:LABEL``, see
    :func:`trace_labels`); the case is ``FAMILY/layerL``. Offending rows are numbered by their
    row in the layer (counted over all its steps), as replay numbers them.

    A trace is production input: a kernel that rejects a step fails the layer's case, with
    ``rejected_documented`` when its docstring names the logits' dtype as unsupported (the seed
    and bf16 logits; exit code 2, as in replay and balance) and ``rejected_undocumented`` otherwise
    (:mod:`routetool.engine.contract`).

    The kernel runs once per captured step; the judgement runs per chunk of steps
    (:mod:`routetool.engine.stream`).
    A layer without logits (ids-only) or without token rows is ``skipped``: the kernel has
    nothing to route there.
    """
    router = trace.meta.router
    device = execution.device
    name = f"{family}/layer{layer}"
    info = trace.info(layer)
    if not info.has_logits:
        return CaseResult(family=family, name=name, description=f"layer {layer}: ids only", verdict="skipped",
                          message="the layer holds no logits (an ids-only trace): nothing to validate")
    if info.num_tokens == 0:
        return CaseResult(family=family, name=name, description=f"layer {layer}: no token rows", verdict="skipped",
                          message="the layer holds no token rows: nothing to validate")
    description = f"layer {layer}: {info.num_tokens} tokens in {info.num_steps} steps"
    start = time.perf_counter()
    bias = trace.bias(layer).to(device)
    first_seen: dict[str, tuple[int, int]] = {}  # class -> (step it first shows in, check order)
    tie_rows = 0
    rows: list[RowReport] = []
    for chunk in stream_layer(trace, layer, device, whole_steps=True):
        case_router = Router(router, fn, kernel_name)
        routed = case_router.route(chunk, bias)
        if not routed.ok:  # a rejection, documented or not, fails too: a trace is production input
            outcome = routed.outcome
            return CaseResult(family=family, name=name, description=description, verdict="fail",
                              failure_classes=[outcome.failure_class],
                              message=str(case_router.error(outcome, f"layer {layer} step {routed.step}",
                                                            path=trace.display_path, layer=layer,
                                                            name=f"kernel {kernel_name!r}")),
                              duration_s=time.perf_counter() - start, exit_code=outcome.exit_code)
        for piece in chunk.pieces():  # the kernel saw whole steps; the checks run over bounded pieces
            inp = CaseInput(gating_output=piece.gating_output, bias=bias, router=router, is_padding=piece.is_padding)
            chunk_classes, chunk_ties, chunk_rows, first_rows = evaluate(
                inp, chunk.rows_of(piece, routed.weights), chunk.rows_of(piece, routed.ids), tie_ulps=tie_ulps,
                first_rows=True)
            for c in chunk_classes:  # (evaluate's check order, whichever piece a class shows in)
                first_seen.setdefault(c, (piece.step_of(first_rows[c]), _check_order(c)))
            tie_rows += chunk_ties
            for r in chunk_rows[:max(0, 3 - len(rows))]:
                r.row += piece.start
                rows.append(r)
    classes = sorted(first_seen, key=first_seen.__getitem__)  # as a step-by-step run meets them
    verdict = "fail" if classes else ("pass_tie" if tie_rows else "pass")
    return CaseResult(
        family=family, name=name, description=description, verdict=verdict, tie_rows=tie_rows,
        failure_classes=classes, message=", ".join(classes) or (f"{tie_rows} tie-equivalent rows" if tie_rows else ""),
        rows=rows, duration_s=time.perf_counter() - start,
    )


def _check_order(failure_class: str) -> int:
    """Where :func:`evaluate` checks ``failure_class`` among the row checks."""
    order = ["mismatch", *(f"invalid:{r}" for r in INVALID_REASONS), "weight_error",
             "weights_not_renormalized_unbiased", "weight_sum"]
    return order.index(failure_class) if failure_class in order else -1


def trace_labels(traces: Sequence) -> list[str]:
    """A family label per trace: its file name, or the path as given where two traces share a
    file name (``a/t.safetensors`` and ``b/t.safetensors``), so that case names stay unique.

    Raises:
        RouteToolError: one file is given twice (the same file after resolving links and
            ``..``): its cases would be run and reported twice under one name.
    """
    seen: dict[Path, str] = {}
    for t in traces:
        key = Path(t).resolve()
        if key in seen:
            raise RouteToolError(f"the trace is given twice ({seen[key]} and {t})", path=t,
                                 fix="name each trace once")
        seen[key] = str(t)
    names = [Path(t).name for t in traces]
    return [n if names.count(n) == 1 else str(t) for n, t in zip(names, traces)]


def validate(
    fn: RoutingFn,
    kernel_name: str,
    execution: Execution,
    *,
    cases: Sequence[Case],
    traces: Sequence = (),
    suite: str | None = None,
    tie_ulps: float = 16.0,
    progress: Callable[[str], None] | None = None,
    planned: Callable[[int], None] | None = None,
    workers: Workers | None = None,
) -> ValidateResult:
    """Run ``fn`` on ``cases`` and on every layer of every trace; return every verdict.

    ``traces``: trace files, indexes or run folders; a run folder's rank ``r`` is the family
    ``trace:LABEL/rank-r``. The units of work (a suite case, a rank's layer) are shared among
    ``workers`` (torchrun; :mod:`routetool.engine.distributed`), the results kept in unit order.
    ``progress``: called with each unit's name after it ran (this process's share); ``planned``:
    with the number of units, once every input is open and before any runs.

    Raises:
        RouteToolError: a trace cannot be read, or one is given twice (:func:`trace_labels`), also
            as a file that two inputs read (:func:`routetool.io.run.refuse_shared_files`).
    """
    from contextlib import ExitStack

    from routetool.io.inputs import open_input
    from routetool.io.run import refuse_shared_files

    workers = workers or Workers()
    with ExitStack() as stack:
        units: list[tuple] = [("case", case) for case in cases]
        opened = []
        partial = []
        for path, label in zip(traces, trace_labels(traces)):
            run = stack.enter_context(open_input(path))
            partial += run.partial
            for rank in run.ranks:
                family = f"trace:{label}" + (f"/{rank.label}" if rank.rank is not None else "")
                opened.append((family, rank.trace))
                units.extend(("layer", rank.trace, layer, family) for layer in rank.trace.layers)
        refuse_shared_files(opened)  # one trace given twice, e.g. by itself and through its run folder
        if planned is not None:
            planned(len(units))

        def work(unit: tuple) -> CaseResult:
            if unit[0] == "case":
                res = run_case(unit[1], fn, execution, tie_ulps=tie_ulps)
            else:
                _, trace, layer, family = unit
                res = validate_layer(trace, layer, family, fn, kernel_name, execution, tie_ulps=tie_ulps)
            if progress is not None:
                progress(res.name)
            return res

        results = workers.run(units, work)
    return ValidateResult(kernel=kernel_name, execution=execution, suite=suite, tie_ulps=tie_ulps, cases=results,
                          world_size=workers.world_size, partial=partial)
