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


@pytest.mark.parametrize("grouping", [
    None,                                            # plain top-k over every expert
    {"n_group": 8, "topk_group": 3},                 # noaux_tc: the keys are -inf outside the kept groups
    {"n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy"},
])
def test_kth_key_is_the_kth_largest_selection_key(grouping):
    # read off the picks, the K-th key must equal a top-k of the keys the reference returns, on rows
    # of ties, signed zeros, infinities, NaN logits and padding
    from routetool_kernels.reference import kth_key, route
    from routetool_kernels.spec import RouterSpec

    E, K = 64, 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 4, (400, E), generator=g).float() / 2  # few distinct values: ties everywhere
    logits[::7] = torch.randn(logits[::7].shape, generator=g)
    logits[2::13, 5] = float("inf")
    logits[3::17] = float("-inf")
    logits[4::19, :9] = float("nan")
    bias = torch.randint(-2, 3, (E,), generator=g).float() / 8
    bias[:4] = -0.0
    pad = torch.zeros(400, dtype=torch.bool)
    pad[5::23] = True
    spec = RouterSpec(num_experts=E, topk=K, route_scale=1.0, **(grouping or {}))
    _, ids, _, keys = route(logits, bias, spec, is_padding=pad)
    kth = kth_key(keys, ids)
    assert kth.shape == (400, 1) and kth.dtype == torch.float32
    assert torch.equal(kth[~pad], torch.topk(keys, K, dim=-1).values[:, K - 1:][~pad])


@pytest.mark.parametrize("normalization", ["sigmoid", "softmax", "sqrtsoftplus", "topk_then_softmax"])
@pytest.mark.parametrize("multiplier", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_leave_the_logits_as_they_were(normalization, multiplier, dtype):
    # the scores are computed in place on a copy of the logits: never on the caller's tensor
    logits = torch.tensor([[1.0, -2.0, float("nan"), float("inf")], [0.5, float("-inf"), 3.0, 0.0]], dtype=dtype)
    before = logits.clone()
    s = normalized_scores(logits, normalization, multiplier)
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(), before.nan_to_num())
    assert s.dtype == torch.float32 and s.data_ptr() != logits.data_ptr() and not s.isnan().any()


# -- the semantics of production models beyond the seed's (docs/semantics.md) ----------------------
def test_group_limited_routing_picks_inside_the_best_groups():
    # DeepSeek-V3's noaux_tc: 8 experts in 4 groups of 2, the 2 best groups by the sum of their top-2 keys.
    # sigmoid keys with the bias: the bias lifts expert 4 (group 2) for selection only.
    logits = torch.tensor([[3.0, -4.0, 1.0, 1.0, -1.0, 0.5, 2.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.6, 0.0, 0.0, 0.0])
    keys = [_sig(v) + b for v, b in zip(logits[0].tolist(), bias.tolist())]
    groups = [keys[0] + keys[1], keys[2] + keys[3], keys[4] + keys[5], keys[6] + keys[7]]
    # 0.971, 1.462, 1.491, 1.762: groups 3 and 2 are kept; expert 0 (the best key of all) is not
    assert sorted(range(4), key=lambda i: -groups[i])[:2] == [3, 2]
    w, ids = musespark1x_routing_reference(logits, bias, 3, 2.5, n_group=4, topk_group=2)
    assert ids.tolist() == [[6, 7, 4]]  # 0.881, 0.881 (equal: lower id first), 0.869
    s = [_sig(2.0), _sig(2.0), _sig(-1.0)]
    assert torch.allclose(w, torch.tensor([[v * 2.5 / sum(s) for v in s]]))
    # without groups, the plain top-3 takes expert 0
    assert musespark1x_routing_reference(logits, bias, 3, 2.5)[1].tolist() == [[0, 6, 7]]
    # topk_group == n_group keeps every group: plain top-k
    assert musespark1x_routing_reference(logits, bias, 3, 2.5, n_group=4, topk_group=4)[1].tolist() == [[0, 6, 7]]


def test_group_limited_routing_ties_and_masked_keys():
    # equal group scores go to the lowest group; the keys outside the kept groups are -inf
    from routetool_kernels.reference import routing_with_scores

    logits = torch.zeros(1, 8)
    w, ids, scores, keys = routing_with_scores(logits, torch.zeros(8), 2, 1.0, n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))
    assert keys[0, 2:].eq(float("-inf")).all() and keys[0, :2].tolist() == [0.5, 0.5]
    # the bias alone keeps group 1, whose logits are -inf: its picks' scores are 0, so weights 0, not 0/0
    logits = torch.tensor([[5.0, 5.0, float("-inf"), float("-inf"), 4.0, 4.0, 4.0, 4.0]])
    bias = torch.tensor([-10.0, -10.0, 20.0, 20.0, 0.0, 0.0, 0.0, 0.0])
    # keys: -9.0, -9.0, 20, 20, 0.98.. x4 -> group 1 (40) is the best; with topk_group=1 the picks are 2 and 3
    w, ids, _, _ = routing_with_scores(logits, bias, 2, 1.0, n_group=4, topk_group=1)
    assert ids.tolist() == [[2, 3]] and w.tolist() == [[0.0, 0.0]]
    # a group whose score is NaN (+inf and -inf keys) counts as -inf, and its +inf key is not picked
    logits = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    bias = torch.tensor([float("inf"), float("-inf"), 0.0, 0.0])
    w, ids, _, keys = routing_with_scores(logits, bias, 1, 1.0, n_group=2, topk_group=1)
    assert ids.tolist() == [[2]] and keys[0, 0] == float("-inf")


def test_group_scores_of_one_expert_groups_are_the_key():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    w, ids = musespark1x_routing_reference(logits, torch.zeros(4), 2, 1.0, n_group=4, topk_group=2)
    assert ids.tolist() == [[1, 3]]


def test_norm_topk_prob_false_keeps_the_raw_scores():
    # Qwen2-MoE / OLMoE: softmax over every expert, top-k, no renormalization
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    e = [math.exp(v) for v in logits[0].tolist()]
    p = [v / sum(e) for v in e]
    w, ids = musespark1x_routing_reference(logits, torch.zeros(4), 2, 1.0, router_score_normalization="softmax",
                                           norm_topk_prob=False)
    assert ids.tolist() == [[2, 1]] and torch.allclose(w, torch.tensor([[p[2], p[1]]]))
    assert float(w.sum()) < 0.91  # 0.665 + 0.245: not 1
    # route_scale still applies (a sigmoid router without renormalization)
    w, _ = musespark1x_routing_reference(logits, torch.zeros(4), 1, 2.0, norm_topk_prob=False)
    assert torch.allclose(w, torch.tensor([[2.0 * _sig(3.0)]]))
    # True is the seed's weights
    assert torch.equal(musespark1x_routing_reference(logits, torch.zeros(4), 2, 1.0, norm_topk_prob=True)[0],
                       musespark1x_routing_reference(logits, torch.zeros(4), 2, 1.0)[0])


def test_sqrtsoftplus_scores_and_weights():
    # DeepSeek-V4: sqrt(softplus(x)), the bias selects, the picked scores renormalised times route_scale
    logits = torch.tensor([[0.0, 1.0, -2.0, 3.0]])
    s = [math.sqrt(math.log1p(math.exp(v))) for v in logits[0].tolist()]
    assert torch.allclose(normalized_scores(logits, "sqrtsoftplus"), torch.tensor([s]))
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0])  # s[2] + 2 = 2.35 beats s[3] = 1.77
    w, ids = musespark1x_routing_reference(logits, bias, 2, 1.5, router_score_normalization="sqrtsoftplus")
    assert ids.tolist() == [[2, 3]]
    assert torch.allclose(w, torch.tensor([[1.5 * s[2] / (s[2] + s[3]), 1.5 * s[3] / (s[2] + s[3])]]))
    # the safe rule: NaN counts as -inf (score 0), +inf as the largest float32 (a finite score)
    x = torch.tensor([[float("nan"), float("inf"), float("-inf"), 50.0]])
    got = normalized_scores(x, "sqrtsoftplus")
    assert got[0, 0] == 0 and got[0, 2] == 0 and torch.isfinite(got).all()
    assert math.isclose(float(got[0, 1]), math.sqrt(torch.finfo(torch.float32).max), rel_tol=1e-6)
    assert math.isclose(float(got[0, 3]), math.sqrt(50.0), rel_tol=1e-6)
    w, ids = musespark1x_routing_reference(x, torch.zeros(4), 2, 1.0, router_score_normalization="sqrtsoftplus",
                                           norm_topk_prob=False)
    assert ids.tolist() == [[1, 3]] and torch.isfinite(w).all()


def test_topk_then_softmax_selects_on_logits_and_softmaxes_the_picks():
    # gpt-oss: top-k of the logits, softmax over the k picked logits
    logits = torch.tensor([[1.0, 4.0, -1.0, 2.5, 0.0]])
    w, ids = musespark1x_routing_reference(logits, torch.zeros(5), 2, 1.0, router_score_normalization="topk_then_softmax")
    assert ids.tolist() == [[1, 3]]
    e = [math.exp(4.0), math.exp(2.5)]
    assert torch.allclose(w, torch.tensor([[e[0] / sum(e), e[1] / sum(e)]]))
    # the classic bug, softmax over every expert and no renormalization, gives smaller weights
    full = torch.softmax(logits, -1)[0, [1, 3]]
    assert (full < w[0]).all()
    # logits far apart, whose full softmax underflows to exact ties, are still told apart by the logits
    x = torch.tensor([[200.0, 0.0, -150.0, -120.0]])
    assert normalized_scores(x, "softmax")[0, 2:].tolist() == [0.0, 0.0]
    w, ids = musespark1x_routing_reference(x, torch.zeros(4), 3, 2.0, router_score_normalization="topk_then_softmax")
    assert ids.tolist() == [[0, 1, 3]] and torch.allclose(w.sum(), torch.tensor(2.0))
    # a row of -inf picks the lowest ids with weights 0; +inf picks share the weight
    x = torch.tensor([[float("-inf")] * 4, [float("inf"), 0.0, float("inf"), 1.0]])
    w, ids = musespark1x_routing_reference(x, torch.zeros(4), 2, 1.0, router_score_normalization="topk_then_softmax")
    assert ids.tolist() == [[0, 1], [0, 2]] and w.tolist() == [[0.0, 0.0], [0.5, 0.5]]


def test_pick_weights_follow_the_spec():
    from routetool_kernels.reference import pick_weights, scores, weight_sum
    from routetool_kernels.spec import RouterSpec

    logits = torch.tensor([[1.0, 4.0, -1.0, 2.5]])
    ids = torch.tensor([[3, 0]])
    gpt = RouterSpec(num_experts=4, topk=2, route_scale=2.0, router_score_normalization="topk_then_softmax")
    e = [math.exp(2.5), math.exp(1.0)]
    assert torch.allclose(pick_weights(scores(logits, gpt), ids, gpt), torch.tensor([[2 * e[0] / sum(e), 2 * e[1] / sum(e)]]))
    # an engine that records the raw top-k scores: the full softmax's
    full = torch.softmax(logits, -1)[0, [3, 0]] * 2.0
    assert torch.allclose(pick_weights(scores(logits, gpt), ids, gpt, renormalized=False), full[None])
    assert weight_sum(gpt) == 2.0
    raw = RouterSpec(num_experts=4, topk=2, router_score_normalization="softmax", norm_topk_prob=False)
    assert weight_sum(raw) is None
    assert torch.allclose(pick_weights(scores(logits, raw), ids, raw), torch.softmax(logits, -1)[0, [3, 0]][None])


def test_group_limited_greedy_scores_a_group_by_its_best_score():
    # DeepSeek-V2's topk_method: group 0 holds the best score, group 1 the best pair
    logits = torch.tensor([[5.0, -9.0, 4.6, 4.6, 0.0, 0.0, 0.0, 0.0]])
    e = [math.exp(v) for v in logits[0].tolist()]
    assert e[0] + e[1] < e[2] + e[3] and e[0] > e[2]
    kwargs = dict(router_score_normalization="softmax", n_group=4, topk_group=1, norm_topk_prob=False)
    w, ids = musespark1x_routing_reference(logits, torch.zeros(8), 2, 16.0, topk_method="group_limited_greedy",
                                           **kwargs)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(w, torch.tensor([[16.0 * e[0] / sum(e), 16.0 * e[1] / sum(e)]]))
    assert musespark1x_routing_reference(logits, torch.zeros(8), 2, 16.0, **kwargs)[1].tolist() == [[2, 3]]
    # noaux_tc is the default group score
    assert musespark1x_routing_reference(logits, torch.zeros(8), 2, 16.0, topk_method="noaux_tc",
                                         **kwargs)[1].tolist() == [[2, 3]]


def test_the_reference_writes_caller_buffers_as_a_kernel_does():
    # a --kernel of the seed's signature: outputs in the [num_tokens, topk] views of larger buffers, int64 ids too
    g = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    weights, ids = torch.full((7, 4), -1.0), torch.full((7, 4), -5, dtype=torch.int64)
    w, i = musespark1x_routing_reference(g, torch.zeros(8), 3, 2.5, None, "softmax", None, weights, ids,
                                         n_group=4, topk_group=2)
    want_w, want_i = musespark1x_routing_reference(g, torch.zeros(8), 3, 2.5, router_score_normalization="softmax",
                                                   n_group=4, topk_group=2)
    assert w.data_ptr() == weights.data_ptr() and i.data_ptr() == ids.data_ptr() and i.dtype == torch.int64
    assert torch.equal(weights[:5, :3], want_w) and torch.equal(ids[:5, :3], want_i.long())
    assert (weights[5:] == -1).all() and (ids[:, 3] == -5).all()  # nothing written outside the view
