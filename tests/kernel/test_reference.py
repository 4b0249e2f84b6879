"""The reference against values computed by hand."""

import math

import pytest
import torch

from routetool_kernels.reference import musespark1x_routing_reference, normalized_scores, select_topk


def _sig(x):
    return 1 / (1 + math.exp(-x))


def test_sigmoid_bias_selects_but_unbiased_scores_weigh():
    # Bias moves expert 3 above expert 0 for selection; weights use the unbiased scores.
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])
    w, ids = musespark1x_routing_reference(logits, bias, 2, 2.5)
    # biased: 0.881, 0.731, 0.269, 1.4 -> picks 3 then 0
    assert ids.tolist() == [[3, 0]]
    s3, s0 = _sig(0.0), _sig(2.0)
    assert torch.allclose(w, torch.tensor([[s3 * 2.5 / (s3 + s0), s0 * 2.5 / (s3 + s0)]]))


def test_multiplier_eps_and_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    bias = torch.zeros(3)
    w, ids = musespark1x_routing_reference(logits, bias, 2, 1.0, router_output_multiplier=0.5,
                                           router_score_normalization="softmax", router_score_division_eps=0.1)
    e = [math.exp(0.5 * v) for v in (1.0, 2.0, 3.0)]
    p = [v / sum(e) for v in e]
    assert ids.tolist() == [[2, 1]]
    assert torch.allclose(w, torch.tensor([[p[2] / (p[2] + p[1] + 0.1), p[1] / (p[2] + p[1] + 0.1)]]))


def test_padding_rows():
    logits = torch.randn(3, 5)
    pad = torch.tensor([False, True, False])
    w, ids = musespark1x_routing_reference(logits, torch.zeros(5), 3, 1.0, is_padding=pad)
    assert ids[1].tolist() == [-1, -1, -1] and w[1].tolist() == [0.0, 0.0, 0.0]
    assert (ids[[0, 2]] >= 0).all()


def test_select_topk_breaks_ties_to_lowest_index_on_large_rows():
    # 384 experts, 40 of them tied at the top: the 8 picks must be the 8 lowest tied indices.
    biased = torch.zeros(2, 384)
    tied = torch.randperm(384, generator=torch.Generator().manual_seed(0))[:40]
    biased[:, tied] = 1.0
    ids = select_topk(biased, 8)
    expected = sorted(tied.tolist())[:8]
    assert ids[0].tolist() == expected and ids[1].tolist() == expected


def test_softmax_rules_for_nonfinite_rows():
    x = torch.tensor([[float("inf"), 0.0, float("inf")], [float("-inf")] * 3, [float("nan"), 0.0, 0.0]])
    s = normalized_scores(x, "softmax")
    assert s[0].tolist() == [0.5, 0.0, 0.5]
    assert s[1].tolist() == [0.0, 0.0, 0.0]
    assert s[2].tolist() == [0.0, 0.5, 0.5]


@pytest.mark.parametrize("E, K", [
    (8, 2),    # Mixtral's shape
    (64, 6),   # ties inside the picks and at the boundary
    (7, 7),    # K == E: the whole row, by the full sort
    (256, 8),  # the production shape
])
def test_select_topk_equals_the_stable_sort_definition(E, K):
    # select_topk takes torch.topk's picks and sorts them; it must equal the definition (a stable
    # descending sort, equal values to the lowest index) on every row, ties and signed zeros included
    from routetool_kernels.reference import select_topk

    g = torch.Generator().manual_seed(E * 31 + K)
    x = torch.randint(-3, 4, (500, E), generator=g).float() / 2  # few distinct values: ties everywhere
    x[::7] = torch.randn(x[::7].shape, generator=g)                # distinct values
    x[1::11, : E // 2] = -0.0                                       # -0.0 against +0.0: equal
    x[2::13, 0] = float("inf")
    x[3::17] = float("-inf")                                         # a row of nothing but -inf
    definition = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(select_topk(x, K), definition)
    assert select_topk(x[:0], K).shape == (0, K)
