"""Row classes on hand-made rows: exact, reordered, tie-equivalent, mismatch, invalid, padded."""

import torch

from routetool_kernels.reference import pick_weights
from routetool_kernels.spec import RouterSpec
from routetool.engine.compare import (INVALID_REASONS, ComparisonSummary, RowClass, compare_step,
                                         weight_tolerance)

E, K = 6, 2
# scores per row (unbiased; bias 0 so biased == scores)
SCORES = torch.tensor([
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 0 exact
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 1 reordered
    [0.9, 0.5, 0.5, 0.2, 0.3, 0.4],   # 2 exact tie at the boundary, other expert picked
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 3 real mismatch: picked 0.4 instead of 0.8
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 4 invalid: duplicate id
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 5 invalid: id out of range
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 6 padded, correct
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 7 padded, but the kernel wrote ids
    [0.9, 0.8, 0.1, 0.2, 0.3, 0.4],   # 8 -1 on an unpadded row
    [0.9, 0.5, 0.5 - 2e-7, 0.2, 0.3, 0.4],  # 9 near tie within a few ulps
])
EXPECTED = torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [0, 1], [-1, -1], [-1, -1], [0, 1], [0, 1]])
TEST = torch.tensor([[0, 1], [1, 0], [0, 2], [0, 5], [0, 0], [0, 6], [-1, -1], [0, 1], [0, -1], [0, 2]])
PAD = torch.tensor([False] * 6 + [True, True] + [False, False])


def _weights(ids):
    w = torch.where(ids >= 0, torch.full(ids.shape, 0.5), 0.0)
    return w


def test_row_classes():
    cmp = compare_step(TEST, _weights(TEST), EXPECTED, _weights(EXPECTED), SCORES, SCORES, PAD,
                       tie_ulps=16, tolerance=weight_tolerance(torch.float32, 1.0))
    classes = [RowClass(int(c)) for c in cmp.row_class]
    assert classes == [
        RowClass.EXACT, RowClass.REORDERED, RowClass.TIE_EQUIVALENT, RowClass.MISMATCH, RowClass.INVALID,
        RowClass.INVALID, RowClass.PADDED, RowClass.INVALID, RowClass.INVALID, RowClass.TIE_EQUIVALENT,
    ]
    reasons = {i: [n for n, on in zip(INVALID_REASONS, cmp.invalid_mask[i].tolist()) if on] for i in (4, 5, 7, 8)}
    assert reasons == {4: ["duplicate_id"], 5: ["id_out_of_range"], 7: ["bad_padding"],
                       8: ["minus_one_on_unpadded_row"]}
    assert cmp.exact_tie.tolist() == [False, False, True] + [False] * 7


def test_exact_ties_only_with_zero_tolerance():
    cmp = compare_step(TEST[9:], None, EXPECTED[9:], None, SCORES[9:], SCORES[9:], None, tie_ulps=0, tolerance=None)
    assert RowClass(int(cmp.row_class[0])) == RowClass.MISMATCH


def test_tie_equivalence_is_the_same_scores_not_just_above_the_kth():
    """Equivalent sets hold the same biased scores; picks above the expected k-th are not enough."""
    scores = torch.tensor([
        [0.9, 0.5, 0.5, 0.2],  # a tied boundary expert picked, but the best one (0.9) left out
        [0.9, 0.8, 0.1, 0.2],  # expected (e.g. a recorded output) holds a wrong pick (0.1): test is right
        [0.9, 0.5, 0.5, 0.5],  # three tied at the boundary: any one of them is equivalent
    ])
    expected = torch.tensor([[0, 1], [0, 2], [0, 1]])
    test = torch.tensor([[2, 1], [0, 1], [3, 0]])
    cmp = compare_step(test, None, expected, None, scores, scores, None, tie_ulps=16, tolerance=None)
    classes = [RowClass(int(c)) for c in cmp.row_class]
    assert classes == [RowClass.MISMATCH, RowClass.MISMATCH, RowClass.TIE_EQUIVALENT]
    assert cmp.exact_tie.tolist() == [False, False, True]
    # and symmetric: the two outputs swapped give the same classes
    swapped = compare_step(expected, None, test, None, scores, scores, None, tie_ulps=16, tolerance=None)
    assert swapped.row_class.tolist() == cmp.row_class.tolist()


def test_tie_ulps_counts_float32_ulps_at_the_scores_magnitude():
    # the tolerance was tie_ulps * 2^-23 * magnitude: up to twice tie_ulps real ulps in [0.5, 1)
    best = torch.tensor(0.99)
    ulp = float(torch.nextafter(best, torch.tensor(2.0)) - best)
    for n, cls in ((16, RowClass.TIE_EQUIVALENT), (17, RowClass.MISMATCH), (31, RowClass.MISMATCH)):
        scores = torch.tensor([[float(best), float(best) - n * ulp, 0.1]])
        assert float(scores[0, 0] - scores[0, 1]) == n * ulp  # exactly n ulps apart
        cmp = compare_step(torch.tensor([[1]]), None, torch.tensor([[0]]), None, scores, scores, None,
                           tie_ulps=16, tolerance=None)
        assert RowClass(int(cmp.row_class[0])) == cls, n


def test_weight_errors_matched_by_expert_id():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2]])
    exp_ids, exp_w = torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.4]])
    # same experts in another order, weights swapped with them: no error
    cmp = compare_step(torch.tensor([[1, 0]]), torch.tensor([[0.4, 0.6]]), exp_ids, exp_w, scores, scores, None,
                       tie_ulps=0, tolerance=weight_tolerance(torch.float32, 1.0))
    assert float(cmp.weight_abs_err[0]) == 0 and not cmp.weight_over_tol[0]
    # a weight off by 1e-3 is over the float32 tolerance but within bf16's
    bad_w = torch.tensor([[0.601, 0.4]])
    for dtype, over in ((torch.float32, True), (torch.bfloat16, False)):
        cmp = compare_step(exp_ids, bad_w, exp_ids, exp_w, scores, scores, None, tie_ulps=0,
                           tolerance=weight_tolerance(dtype, 1.0))
        assert abs(float(cmp.weight_abs_err[0]) - 1e-3) < 1e-6
        assert bool(cmp.weight_over_tol[0]) is over


def _spec(route_scale: float, eps: float | None = None) -> RouterSpec:
    return RouterSpec(num_experts=4, topk=2, route_scale=route_scale, router_score_division_eps=eps)


def test_tie_equivalent_rows_weights_are_checked_against_their_own_picks():
    scores = torch.tensor([[0.9, 0.5, 0.5, 0.2]])  # experts 1 and 2 tie for the 2nd place
    exp_ids, test_ids = torch.tensor([[0, 1]]), torch.tensor([[0, 2]])
    own = pick_weights(scores, test_ids, _spec(2.0))
    assert torch.allclose(own, torch.tensor([[0.9, 0.5]]) * 2.0 / 1.4)
    tol = weight_tolerance(torch.float32, 2.0)
    exp_w = pick_weights(scores, exp_ids, _spec(2.0))
    right = compare_step(test_ids, own, exp_ids, exp_w, scores, scores, None, tie_ulps=0, tolerance=tol,
                         own_weights=own)
    assert RowClass(int(right.row_class[0])) == RowClass.TIE_EQUIVALENT and not right.weight_over_tol[0]
    doubled = own * 2
    # without own_weights nothing of the row is compared (no expert matches by id and weight)...
    unchecked = compare_step(test_ids, doubled, exp_ids, exp_w, scores, scores, None, tie_ulps=0, tolerance=tol)
    assert not unchecked.weight_over_tol[0]
    # ...with them the doubled weights are found
    wrong = compare_step(test_ids, doubled, exp_ids, exp_w, scores, scores, None, tie_ulps=0, tolerance=tol,
                         own_weights=own)
    assert wrong.weight_over_tol[0] and abs(float(wrong.weight_rel_err[0]) - 1.0) < 1e-6


def test_pick_weights_eps_zero_denominator_and_unnormalized():
    scores = torch.tensor([[0.6, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ids = torch.tensor([[0, 1], [2, 3]])
    w = pick_weights(scores, ids, _spec(1.5, 0.2))
    assert torch.allclose(w[0], torch.tensor([0.6, 0.2]) * 1.5 / 1.0) and (w[1] == 0).all()
    assert torch.allclose(pick_weights(scores, ids, _spec(1.5), renormalized=False)[0], torch.tensor([0.9, 0.3]))


def test_summary_counts_and_failures():
    tol = weight_tolerance(torch.float32, 1.0)
    cmp = compare_step(TEST, _weights(TEST), EXPECTED, _weights(EXPECTED), SCORES, SCORES, PAD, tie_ulps=16,
                       tolerance=tol)
    s = ComparisonSummary()
    s.add(cmp, layer=3, step=1, start=100, test_ids=TEST, test_weights=_weights(TEST), expected_ids=EXPECTED,
          expected_weights=_weights(EXPECTED), tolerance=tol)
    assert (s.rows, s.exact, s.reordered, s.tie_equivalent, s.mismatch, s.invalid, s.padded) == (10, 1, 1, 2, 1, 4, 1)
    assert not s.ok
    assert [f.row for f in s.failures] == [103, 104, 105, 107, 108]
    assert s.failures[0].row_class == "mismatch" and s.failures[0].test_ids == [0, 5]
