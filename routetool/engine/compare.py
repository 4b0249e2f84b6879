"""Tie-aware comparison of routing outputs.

Exact id comparison is wrong on real traffic: bf16 logits make exact ties between experts
common, and two correct implementations may break a tie (or a near-tie inside float32
rounding) differently. Each token row is therefore put in one class:

* ``exact``: same ids in the same order;
* ``reordered``: same set of experts, another order;
* ``tie_equivalent``: different experts with the same biased scores (by the reference's
  scores): sorted, the picks' biased scores equal the expected picks' ones pick by pick, up
  to a tolerance of ``tie_ulps`` float32 ulps at the magnitude of the scores involved
  (0 = exact ties only), so every difference lies inside a tie;
* ``mismatch``: other experts whose biased scores differ from the expected picks' (a pick
  below the expected k-th score, or an expected pick above it left out): a real error;
* ``invalid``: an id out of range, a duplicate id, -1 on an unpadded row, a non-finite or
  negative weight, or a padded row not exactly -1 / 0.0;
* ``padded``: a padded row correctly set to -1 / 0.0.

Weights are compared matched by expert id, on rows that hold the same experts (exact and
reordered rows), against an absolute + relative tolerance chosen from the dtype of the weights
being compared. A tie-equivalent row picked another expert, and the renormalisation then
changes every weight of the row, so its weights are not compared with the expected ones.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

def float32_ulp(x: torch.Tensor) -> torch.Tensor:
    """The float32 ulp (spacing of float32 numbers) at magnitude ``|x|``: ``2^(e - 23)`` for
    ``2^e <= |x| < 2^(e+1)``, and ``2^-149`` (the smallest subnormal) below ``2^-126``."""
    tiny = torch.finfo(torch.float32).tiny
    _, exponent = torch.frexp(x.abs().float().clamp_min(tiny))  # |x| = m * 2^exponent, m in [0.5, 1)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 24)


class RowClass(IntEnum):
    """Class of one token row in a comparison (see the module docstring)."""

    EXACT = 0
    REORDERED = 1
    TIE_EQUIVALENT = 2
    MISMATCH = 3
    INVALID = 4
    PADDED = 5


INVALID_REASONS = (
    "id_out_of_range",
    "duplicate_id",
    "minus_one_on_unpadded_row",
    "nonfinite_weight",
    "negative_weight",
    "bad_padding",
)


@dataclass(frozen=True)
class WeightTolerance:
    """``|test - expected| <= atol + rtol * |expected|`` for matched weights."""

    rtol: float
    atol: float


def weight_tolerance(dtype: torch.dtype, route_scale: float) -> WeightTolerance:
    """Tolerance for weights stored in ``dtype`` (the coarser of the two compared).

    float32 weights computed from the same float32 scores differ only by the rounding of
    a few ulps in exp/sigmoid and in the summation order: rtol 1e-5. Recorded bf16/fp16
    weights carry their storage rounding (2^-9 / 2^-12 relative): rtol 1e-2 / 1e-3.
    ``atol`` is relative to ``route_scale``, the size of a row's weight sum.
    """
    if dtype == torch.bfloat16:
        return WeightTolerance(rtol=1e-2, atol=1e-3 * route_scale)
    if dtype == torch.float16:
        return WeightTolerance(rtol=1e-3, atol=1e-4 * route_scale)
    return WeightTolerance(rtol=1e-5, atol=1e-6 * route_scale)


def coarser_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the fewest mantissa bits among ``dtypes``."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


@dataclass
class StepComparison:
    """Per-row results of comparing one step (tensors on the compared device).

    Attributes:
        row_class: ``[n]`` int8 :class:`RowClass` values.
        invalid_mask: ``[n, len(INVALID_REASONS)]`` bool, which reasons apply to a row.
        exact_tie: ``[n]`` bool, tie-equivalent rows whose alternative picks tie exactly.
        weight_abs_err: ``[n]`` float32 max |test - expected| over experts in both.
        weight_rel_err: ``[n]`` float32 max relative error over experts in both.
        weight_over_tol: ``[n]`` bool, a matched weight outside the tolerance.
    """

    row_class: torch.Tensor
    invalid_mask: torch.Tensor
    exact_tie: torch.Tensor
    weight_abs_err: torch.Tensor | None
    weight_rel_err: torch.Tensor | None
    weight_over_tol: torch.Tensor | None


def invalid_reasons(ids: torch.Tensor, weights: torch.Tensor | None, is_padding: torch.Tensor | None,
                    num_experts: int) -> torch.Tensor:
    """Which :data:`INVALID_REASONS` apply to each row of one routing output (no reference needed).

    Args:
        ids: ``[n, K]`` int expert ids. weights: ``[n, K]`` weights, or None (weight reasons
            are then not checked). is_padding: ``[n]`` bool or None. num_experts: E.

    Returns:
        ``[n, len(INVALID_REASONS)]`` bool on ``ids``'s device.
    """
    n = ids.shape[0]
    device = ids.device
    ids = ids.to(torch.int64)
    pad = is_padding.to(device) if is_padding is not None else torch.zeros(n, dtype=torch.bool, device=device)
    in_range = (ids >= 0) & (ids < num_experts)
    sorted_ids = ids.sort(dim=-1).values
    reasons = torch.zeros((n, len(INVALID_REASONS)), dtype=torch.bool, device=device)
    unpadded = ~pad
    reasons[:, 0] = unpadded & (~in_range & (ids != -1)).any(-1)
    reasons[:, 1] = unpadded & (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(-1) & in_range.all(-1)
    reasons[:, 2] = unpadded & (ids == -1).any(-1)
    if weights is not None:
        w = weights.to(device=device, dtype=torch.float32)
        reasons[:, 3] = unpadded & (~torch.isfinite(w)).any(-1)
        reasons[:, 4] = unpadded & (w < 0).any(-1)
        reasons[:, 5] = pad & ~((ids == -1).all(-1) & (w == 0).all(-1))
    else:
        reasons[:, 5] = pad & ~(ids == -1).all(-1)
    return reasons


def compare_step(
    test_ids: torch.Tensor,
    test_weights: torch.Tensor | None,
    expected_ids: torch.Tensor,
    expected_weights: torch.Tensor | None,
    scores: torch.Tensor,
    biased: torch.Tensor,
    is_padding: torch.Tensor | None,
    *,
    tie_ulps: float,
    tolerance: WeightTolerance | None,
    own_weights: torch.Tensor | None = None,
    row_chunk: int = 16384,
) -> StepComparison:
    """Classify each row of ``test`` against ``expected``.

    Args:
        test_ids: ``[n, K]`` int ids under test (e.g. the kernel's).
        test_weights: ``[n, K]`` weights under test, or None to skip weight checks.
        expected_ids: ``[n, K]`` int ids taken as correct (reference or recorded); for
            padded rows their value is ignored.
        expected_weights: ``[n, K]`` expected weights, or None.
        scores: ``[n, E]`` float32 unbiased scores from the reference.
        biased: ``[n, E]`` float32 biased scores (selection keys) from the reference.
        is_padding: ``[n]`` bool or None.
        tie_ulps: near-tie tolerance in float32 ulps (0 = exact ties only).
        tolerance: weight tolerance (None skips weight checks).
        own_weights: ``[n, K]`` the weights ``test_ids`` should carry, position by position
            (:func:`routetool_kernels.reference.pick_weights`), or None. Given, a tie-equivalent row's weights are
            checked against them (it picked other experts than ``expected``, so no weight of
            the row matches an expected one); without them such rows' weights go unchecked.
        row_chunk: rows per internal chunk for the ``[n, E]`` temporaries.

    Returns:
        A :class:`StepComparison`.
    """
    n, k = test_ids.shape
    E = scores.shape[1]
    device = scores.device
    pad = is_padding.to(device) if is_padding is not None else torch.zeros(n, dtype=torch.bool, device=device)
    ids = test_ids.to(device=device, dtype=torch.int64)
    exp_ids = expected_ids.to(device=device, dtype=torch.int64)
    check_weights = test_weights is not None and expected_weights is not None and tolerance is not None

    sorted_ids = ids.sort(dim=-1).values
    reasons = invalid_reasons(ids, test_weights, pad, E)
    invalid = reasons.any(-1)

    safe_ids = ids.clamp(0, E - 1)
    safe_exp = exp_ids.clamp(0, E - 1)
    exact = (ids == exp_ids).all(-1)
    same_set = (sorted_ids == exp_ids.sort(dim=-1).values).all(-1)
    # Other experts are equivalent when the two sets hold the same biased scores: sorted, pick
    # by pick, equal or within the tolerance (every difference lies inside a tie). Comparing
    # only against the expected k-th score would pass a set that drops a higher expert for
    # one tied at the boundary, and any set at all when the expected picks are the wrong ones.
    b_exp, order_exp = biased.gather(1, safe_exp).sort(dim=-1, descending=True)
    s_exp = scores.gather(1, safe_exp.gather(1, order_exp))
    b_test, order_test = biased.gather(1, safe_ids).sort(dim=-1, descending=True)
    s_test = scores.gather(1, safe_ids.gather(1, order_test))
    magnitude = torch.stack([b_exp.abs(), s_exp, b_test.abs(), s_test], 0).amax(0)
    magnitude = torch.where(torch.isfinite(magnitude), magnitude, 0.0)
    tol = tie_ulps * float32_ulp(magnitude)
    # -inf == -inf counts as a tie (rows of non-finite logits); the subtraction would give NaN.
    equal = b_test == b_exp
    tie_equiv = (equal | ((b_test - b_exp).abs() <= tol)).all(-1)
    exact_tie = equal.all(-1)

    row_class = torch.full((n,), int(RowClass.MISMATCH), dtype=torch.int8, device=device)
    row_class = torch.where(tie_equiv, int(RowClass.TIE_EQUIVALENT), row_class)
    row_class = torch.where(same_set, int(RowClass.REORDERED), row_class)
    row_class = torch.where(exact, int(RowClass.EXACT), row_class)
    row_class = torch.where(invalid, int(RowClass.INVALID), row_class)
    row_class = torch.where(pad & ~invalid, int(RowClass.PADDED), row_class).to(torch.int8)
    exact_tie = exact_tie & (row_class == int(RowClass.TIE_EQUIVALENT))

    abs_err = rel_err = over = None
    if check_weights:
        tw = test_weights.to(device=device, dtype=torch.float32)
        ew = expected_weights.to(device=device, dtype=torch.float32)
        # Weights are compared where both outputs hold the same experts. A tie-equivalent row
        # picked another expert, which changes the renormalisation of every weight of the row:
        # its weights are checked against its own picks instead (``own_weights``), below.
        comparable = ~pad & ~invalid & same_set
        abs_parts, rel_parts, over_parts = [], [], []
        for lo in range(0, n, row_chunk):
            hi = min(n, lo + row_chunk)
            m = hi - lo
            dense_exp = torch.zeros((m, E), device=device).scatter_(1, safe_exp[lo:hi], ew[lo:hi])
            sel_exp = torch.zeros((m, E), dtype=torch.bool, device=device).scatter_(1, safe_exp[lo:hi], True)
            dense_test = torch.zeros((m, E), device=device).scatter_(1, safe_ids[lo:hi], tw[lo:hi])
            sel_test = torch.zeros((m, E), dtype=torch.bool, device=device).scatter_(1, safe_ids[lo:hi], True)
            both = sel_exp & sel_test & comparable[lo:hi, None]
            err = torch.where(both, (dense_test - dense_exp).abs(), 0.0)
            rel = torch.where(both, err / dense_exp.abs().clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            limit = tolerance.atol + tolerance.rtol * dense_exp.abs()
            abs_parts.append(err.amax(-1))
            rel_parts.append(rel.amax(-1))
            over_parts.append((both & (err > limit)).any(-1))
        empty = torch.zeros(0, device=device)
        abs_err = torch.cat(abs_parts) if abs_parts else empty
        rel_err = torch.cat(rel_parts) if rel_parts else empty
        over = torch.cat(over_parts) if over_parts else empty.bool()
        if own_weights is not None:
            tie = (row_class == int(RowClass.TIE_EQUIVALENT))[:, None]
            own = own_weights.to(device=device, dtype=torch.float32)
            err = torch.where(tie, (tw - own).abs(), 0.0)
            rel = torch.where(tie, err / own.abs().clamp_min(torch.finfo(torch.float32).tiny), 0.0)
            abs_err = torch.maximum(abs_err, err.amax(-1))
            rel_err = torch.maximum(rel_err, rel.amax(-1))
            over = over | (tie & (err > tolerance.atol + tolerance.rtol * own.abs())).any(-1)
    return StepComparison(
        row_class=row_class, invalid_mask=reasons, exact_tie=exact_tie,
        weight_abs_err=abs_err, weight_rel_err=rel_err, weight_over_tol=over,
    )


@dataclass
class RowFailure:
    """One failing row, for the report: where (``rank``: the run folder's rank, None for one
    trace), what class, and both outputs."""

    layer: int
    step: int
    row: int
    row_class: str
    reasons: list[str]
    expected_ids: list[int]
    test_ids: list[int]
    expected_weights: list[float] | None
    test_weights: list[float] | None
    rank: int | None = None


@dataclass
class ComparisonSummary:
    """Counts of a comparison accumulated over steps (and layers).

    Attributes:
        rows: rows compared. exact ... padded: rows per :class:`RowClass`.
        exact_ties: tie-equivalent rows whose alternative picks tie exactly.
        invalid_reasons: reason -> rows.
        weight_max_abs_err / weight_max_rel_err: over experts present in both outputs.
        weight_rows_over_tolerance: rows with a matched weight outside the tolerance.
        weight_rtol / weight_atol: the tolerance used (None when weights were not compared).
        failures: the first few failing rows.
    """

    rows: int = 0
    exact: int = 0
    reordered: int = 0
    tie_equivalent: int = 0
    exact_ties: int = 0
    mismatch: int = 0
    invalid: int = 0
    padded: int = 0
    invalid_reasons: dict[str, int] = field(default_factory=lambda: {r: 0 for r in INVALID_REASONS})
    weight_max_abs_err: float | None = None
    weight_max_rel_err: float | None = None
    weight_rows_over_tolerance: int = 0
    weight_rtol: float | None = None
    weight_atol: float | None = None
    failures: list[RowFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No mismatch, no invalid output, no weight outside tolerance."""
        return self.mismatch == 0 and self.invalid == 0 and self.weight_rows_over_tolerance == 0

    def add(
        self,
        cmp: StepComparison,
        *,
        layer: int,
        step: int,
        start: int,
        test_ids: torch.Tensor,
        test_weights: torch.Tensor | None,
        expected_ids: torch.Tensor,
        expected_weights: torch.Tensor | None,
        tolerance: WeightTolerance | None,
        max_failures: int = 5,
        step_offsets: Sequence[int] | None = None,
    ) -> None:
        """Accumulate the :class:`StepComparison` of one step, or of a chunk of consecutive steps.

        ``start``: the layer row of the first compared row (failing rows are named by their row
        in the layer). ``step``: the step of the first row; for a chunk, ``step_offsets`` gives
        its step boundaries (``[0, n_0, n_0 + n_1, ...]``) so that each failing row is named by
        its own step."""
        counts = torch.bincount(cmp.row_class.long(), minlength=len(RowClass)).tolist()
        self.rows += int(cmp.row_class.numel())
        self.exact += counts[RowClass.EXACT]
        self.reordered += counts[RowClass.REORDERED]
        self.tie_equivalent += counts[RowClass.TIE_EQUIVALENT]
        self.mismatch += counts[RowClass.MISMATCH]
        self.invalid += counts[RowClass.INVALID]
        self.padded += counts[RowClass.PADDED]
        self.exact_ties += int(cmp.exact_tie.sum())
        for name, c in zip(INVALID_REASONS, cmp.invalid_mask.sum(0).tolist()):
            self.invalid_reasons[name] += int(c)
        weight_fail = torch.zeros_like(cmp.row_class, dtype=torch.bool)
        if cmp.weight_abs_err is not None and tolerance is not None:
            self.weight_rtol, self.weight_atol = tolerance.rtol, tolerance.atol
            if cmp.weight_abs_err.numel():
                a = float(cmp.weight_abs_err.max())
                r = float(cmp.weight_rel_err.max())
                self.weight_max_abs_err = a if self.weight_max_abs_err is None else max(a, self.weight_max_abs_err)
                self.weight_max_rel_err = r if self.weight_max_rel_err is None else max(r, self.weight_max_rel_err)
            self.weight_rows_over_tolerance += int(cmp.weight_over_tol.sum())
            weight_fail = cmp.weight_over_tol
        if len(self.failures) >= max_failures:
            return
        bad = ((cmp.row_class == RowClass.MISMATCH) | (cmp.row_class == RowClass.INVALID) | weight_fail)
        rows = torch.nonzero(bad).flatten()[: max_failures - len(self.failures)].tolist()
        for r in rows:
            cls = RowClass(int(cmp.row_class[r]))
            reasons = [n for n, on in zip(INVALID_REASONS, cmp.invalid_mask[r].tolist()) if on]
            if weight_fail[r] and cls not in (RowClass.MISMATCH, RowClass.INVALID):
                reasons.append("weight_outside_tolerance")
            self.failures.append(RowFailure(
                layer=layer, step=step if step_offsets is None else step + bisect.bisect_right(step_offsets, r) - 1,
                row=start + r, row_class=cls.name.lower(), reasons=reasons,
                expected_ids=[int(v) for v in expected_ids[r].tolist()],
                test_ids=[int(v) for v in test_ids[r].tolist()],
                expected_weights=None if expected_weights is None else [float(v) for v in expected_weights[r].float().tolist()],
                test_weights=None if test_weights is None else [float(v) for v in test_weights[r].float().tolist()],
            ))

    def merge(self, other: ComparisonSummary, max_failures: int = 5) -> None:
        """Add ``other``'s counts into this summary (for totals over layers)."""
        for name in ("rows", "exact", "reordered", "tie_equivalent", "exact_ties", "mismatch", "invalid",
                     "padded", "weight_rows_over_tolerance"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.invalid_reasons.items():
            self.invalid_reasons[k] = self.invalid_reasons.get(k, 0) + v
        for name in ("weight_max_abs_err", "weight_max_rel_err"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None:
                setattr(self, name, theirs if mine is None else max(mine, theirs))
        if other.weight_rtol is not None:
            self.weight_rtol, self.weight_atol = other.weight_rtol, other.weight_atol
        self.failures.extend(other.failures[: max(0, max_failures - len(self.failures))])


def boundary_margins(biased: torch.Tensor, topk: int, is_padding: torch.Tensor | None) -> torch.Tensor:
    """Per-row gap between the k-th and (k+1)-th largest biased score (unpadded rows only).

    Args:
        biased: ``[n, E]`` float32 selection keys. topk: K. is_padding: ``[n]`` bool or None.

    Returns:
        ``[m]`` float32 margins (>= 0) of the unpadded rows; empty when ``topk == E``. Rows
        whose k-th and (k+1)-th keys are both -inf have margin 0 (a tie).
    """
    n, E = biased.shape
    if topk >= E or n == 0:
        return torch.zeros(0, device=biased.device)
    values = torch.topk(biased, topk + 1, dim=-1).values
    margin = values[:, topk - 1] - values[:, topk]
    margin = torch.nan_to_num(margin, nan=0.0)
    if is_padding is not None:
        margin = margin[~is_padding.to(margin.device)]
    return margin
