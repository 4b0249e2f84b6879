"""Load-balance analysis: numbers computed by hand on small inputs."""

import pytest
import torch

from routetool.analysis.balance import (
    BalanceOptions,
    CountsSource,
    EplbOptions,
    ImportedSource,
    TraceSource,
    analyze_balance,
    count_experts,
    default_ep_sizes,
    route_fn_from,
    tokens_per_rank,
    tv_distance,
    window_of_steps,
)
from routetool.errors import EXIT_FINDINGS, EXIT_USAGE, KernelError, RouteToolError
from routetool.io.dumps import ImportedCounts, ImportedLayer, ImportedRouting
from routetool.engine.load import load_stats
from routetool.io.trace import LayerArrays, RouterConfig, Trace


# -- primitives -------------------------------------------------------------------------------
def test_count_experts_skips_padding_and_bad_ids(device):
    ids = torch.tensor([[0, 1], [0, 2], [-1, -1], [3, 7]], device=device)
    counts, uncounted = count_experts(ids, 4)
    assert counts.tolist() == [2, 1, 1, 1] and int(uncounted) == 3


def test_tokens_per_rank_counts_a_token_once_per_rank(device):
    # experts 0,1 on rank 0; 2,3 on rank 1. Row 0 -> rank 0 once; row 1 -> both; row 2 -> rank 1
    ids = torch.tensor([[0, 1], [0, 2], [3, -1]], device=device)
    out = tokens_per_rank(ids, torch.tensor([0, 0, 1, 1], device=device), 2)
    assert out.tolist() == [2, 2]


def test_tv_distance():
    assert tv_distance(torch.tensor([1, 0]), torch.tensor([0, 5])) == 1.0
    assert tv_distance(torch.tensor([2, 2]), torch.tensor([5, 5])) == 0.0
    assert tv_distance(torch.tensor([3, 1]), torch.tensor([1, 1])) == pytest.approx(0.25)
    assert tv_distance(torch.tensor([0, 0]), torch.tensor([1, 1])) is None


@pytest.mark.parametrize("sizes, windows, expected", [
    ([10, 10, 10, 10], 2, ([0, 0, 1, 1], 2)),
    ([2, 3], 2, ([0, 1], 2)),                 # midpoints 1 and 3.5 of 5 rows
    ([100, 1, 1, 1], 4, ([0, 1, 1, 1], 2)),   # one huge step: empty windows dropped
    ([5], 8, ([0], 1)),                       # never more windows than steps
])
def test_window_of_steps(sizes, windows, expected):
    assert window_of_steps(sizes, windows) == expected


def test_default_ep_sizes():
    assert default_ep_sizes(256) == [8] and default_ep_sizes(60) == [4] and default_ep_sizes(7) == [1]


# -- the analysis on a hand-made routing ---------------------------------------------------------
def _two_steps() -> ImportedRouting:
    # step 0 (2 tokens): [[0,1],[0,2]] -> counts [2,1,1,0]
    # step 1 (3 tokens): [[0,1],[2,3],[0,3]] -> counts [2,1,1,2]; total [4,2,2,2]
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 3], [0, 3]], dtype=torch.int32)
    layer = ImportedLayer(topk_ids=ids, topk_weights=None, step_offsets=[0, 2, 5])
    return ImportedRouting(source="hand", format="jsonl", model="m", num_experts=4, topk=2, layers={5: layer})


def test_expert_and_rank_numbers_by_hand(device):
    src = ImportedSource(_two_steps(), decode_max_tokens=2)
    r = analyze_balance(src, BalanceOptions(ep_sizes=[2], windows=2, capacity_factors=[1.0, 1.25, 2.0], eplb=None),
                        device)
    x = r.layers[0]
    assert (x.layer, x.num_steps, x.tokens, x.assignments) == (5, 2, 5, 10)
    assert x.counts == [4, 2, 2, 2]
    assert x.load.imbalance == pytest.approx(4 / 2.5)
    rank = x.ranks[0]
    assert rank.assignments == [6.0, 4.0]                 # experts {0,1} and {2,3}
    assert rank.balancedness == pytest.approx(5 / 6)
    assert rank.hottest_rank == 0 and rank.hottest_share == pytest.approx(0.6)
    assert rank.tokens_received == [4, 3]                 # step 0: [2,1]; step 1: [2,2]
    q = rank.step_balancedness                            # step 0 ranks [3,1] -> 2/3; step 1 [3,3] -> 1
    assert (q.count, q.min, q.mean) == (2, pytest.approx(2 / 3), pytest.approx(5 / 6))
    # capacity: step 0 has 4 assignments, step 1 has 6
    # cf 1.0: caps ceil(1)=1, ceil(1.5)=2 -> expert 0 overflows by 1 in step 0
    # cf 1.25: caps ceil(1.25)=2, ceil(1.875)=2 -> nothing; cf 2: nothing
    c1, c125, c2 = x.capacity
    assert c1.overflow == [1, 0, 0, 0] and c1.dropped == 1 and c1.dropped_fraction == pytest.approx(0.1)
    assert (c1.experts_overflowing, c1.steps_overflowing) == (1, 1)
    assert c125.dropped == 0 and c2.dropped == 0
    # phases: step 0 (2 tokens <= 2) decode, step 1 prefill; TV([.5,.25,.25,0], [1/3,1/6,1/6,1/3]) = 1/3
    assert {p.phase: p.tokens for p in x.phases} == {"prefill": 3, "decode": 2}
    assert x.phase_tv_distance == pytest.approx(1 / 3)
    # windows: one step each; window 0 TV vs layer: 0.5 * (|.5-.4| + |.25-.2|*2 + |0-.2|) = 0.2
    assert [w.assignments for w in x.windows] == [4, 6]
    assert x.windows[0].tv_distance == pytest.approx(0.2)
    assert x.windows[0].balancedness == pytest.approx(2 / 3)
    assert r.ep[0].step_balancedness_mean == pytest.approx(5 / 6)


def test_eplb_whatif_by_hand(device):
    # layer counts [4,2,2,2] on 2 GPUs with 2 redundant experts: e0 gets 2 extra replicas
    # (4/2=2 ties with the others; lowest index wins), slot loads [1.33,2,2,2,1.33,1.33] pack to
    # {2,2,1.33} | {2,1.33,1.33} = 5.33 | 4.67 -> balancedness 5 / 5.33 = 0.9375 (before: 5/6)
    src = ImportedSource(_two_steps())
    r = analyze_balance(src, BalanceOptions(ep_sizes=[2], windows=2, eplb=EplbOptions(num_redundant=2)), device)
    e = r.eplb
    assert (e.num_gpus, e.num_redundant, e.policy) == (2, 2, "global")
    y = e.layers[0]
    assert y.balancedness_before == pytest.approx(5 / 6)
    assert y.balancedness_after == pytest.approx(5 / (16 / 3))
    assert y.max_rank_load_before == 6.0 and y.max_rank_load_after == pytest.approx(16 / 3)
    assert y.replicated == [(0, 3)]
    assert e.placement.logical_count.tolist() == [[3, 1, 1, 1]]
    # holdout: fitted on window 0 ([2,1,1,0]), measured on window 1 ([2,1,1,2])
    assert y.holdout_before == pytest.approx(1.0)   # window 1 ranks [3,3]
    assert y.holdout_after is not None


def test_eplb_default_is_one_redundant_expert_per_gpu():
    r = analyze_balance(ImportedSource(_two_steps()), BalanceOptions(ep_sizes=[2]))
    assert r.eplb.num_redundant == 2 and r.eplb.num_gpus == 2


@pytest.mark.parametrize("options, words", [
    (BalanceOptions(ep_sizes=[3], eplb=None), "cannot be split evenly over 3 EP ranks"),
    (BalanceOptions(ep_sizes=[2], eplb=EplbOptions(num_redundant=1)), "multiple of the 2 GPUs"),
])
def test_impossible_configurations(options, words):
    with pytest.raises(RouteToolError, match=words):
        analyze_balance(ImportedSource(_two_steps()), options)


def test_counts_source_capacity_from_assignments():
    # 2 steps of counts; no topk -> tokens unknown; capacity needs only assignments per step
    counts = ImportedCounts(source="c", format="counts-json", model="m", num_experts=4, topk=None,
                            layers={0: torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2]])}, step_labels=["a", "b"])
    r = analyze_balance(CountsSource(counts), BalanceOptions(ep_sizes=[2], windows=8, capacity_factors=[1.0], eplb=None))
    x = r.layers[0]
    assert x.tokens is None and x.assignments == 16
    # step a: cap ceil(8/4)=2 -> expert 0 overflows by 4; step b: cap 2 -> none
    assert x.capacity[0].overflow == [4, 0, 0, 0]
    assert [w.label for w in x.windows] == ["a", "b"]
    assert x.ranks[0].tokens_received is None  # counts have no per-token ids
    assert x.ranks[0].balancedness == pytest.approx(8 / 12)  # ranks [6+2+2+2, 2+2] = [12, 4]


# -- no traffic: statistics undefined, not 0 ----------------------------------------------------
def _counts(layers: dict[int, list[list[int]]]) -> CountsSource:
    return CountsSource(ImportedCounts(source="z.json", format="counts-json", model="m", num_experts=4, topk=None,
                                       layers={x: torch.tensor(m) for x, m in layers.items()},
                                       step_labels=[str(i) for i in range(len(next(iter(layers.values()))))]))


def test_load_statistics_without_traffic_are_undefined():
    # max/mean, CV, entropy and Gini of an all-zero histogram were 0 (0 reads as a perfectly even load)
    st = load_stats(torch.zeros(4, dtype=torch.int64))
    assert (st.imbalance, st.cv, st.normalized_entropy, st.gini) == (None, None, None, None)
    assert (st.assignments, st.max_load, st.mean_load, st.hottest, st.idle) == (0, 0, 0.0, [], [0, 1, 2, 3])
    one = load_stats(torch.tensor([0, 0, 3, 0]))  # one expert: defined, the extreme values
    assert (one.imbalance, one.normalized_entropy, one.gini) == (pytest.approx(4.0), 0.0, pytest.approx(0.75))


def test_a_source_without_traffic(device):
    # EPLB put every redundant slot on expert 0 (ties to the lowest index on an all-zero load): an
    # even load spreads them, one per expert; hottest rank 0 of nothing is no hottest rank
    r = analyze_balance(_counts({0: [[0, 0, 0, 0]]}),
                        BalanceOptions(ep_sizes=[2], windows=2, eplb=EplbOptions(num_redundant=4)), device)
    x = r.layers[0]
    assert (x.load.imbalance, x.load.cv, x.load.normalized_entropy, x.load.gini) == (None,) * 4
    assert r.total_load.imbalance is None and r.total_load.gini is None
    assert x.ranks[0].balancedness is None and x.ranks[0].hottest_rank is None and x.ranks[0].hottest_share is None
    assert [(w.imbalance, w.cv, w.top_expert) for w in x.windows] == [(None, None, None)]
    assert r.eplb.layers[0].replicated == [(0, 2), (1, 2), (2, 2), (3, 2)]
    assert r.eplb.layers[0].balancedness_after is None
    assert r.notes[0].startswith("z.json holds no traffic (0 assignments in the analysed layers)")


def test_a_layer_without_traffic_among_others(device):
    # layer 1 has traffic, layer 0 none: layer 0's statistics are undefined, the rest as usual; the
    # holdout of layer 1 is fitted on window "0", which is empty: an even load there too
    r = analyze_balance(_counts({0: [[0, 0, 0, 0], [0, 0, 0, 0]], 1: [[0, 0, 0, 0], [1, 2, 3, 4]]}),
                        BalanceOptions(ep_sizes=[2], windows=2, eplb=EplbOptions(num_redundant=2)), device)
    empty, busy = r.layers
    assert empty.load.imbalance is None and busy.load.imbalance == pytest.approx(1.6)
    assert r.ep[0].worst_layer == 1 and r.ep[0].balancedness.count == 1
    assert r.eplb.layers[0].replicated == [(0, 2), (1, 2)]
    assert r.eplb.layers[1].replicated == [(2, 2), (3, 2)]  # 4/2 = 2 ties with 3: e3, then e2
    # holdout fitted on an even load: e0, e1 replicated, GPUs {e2, e0, e0} | {e3, e1, e1}; measured on
    # [1,2,3,4]: 4 | 6 -> 5/6 (fitted on zeros, e0 took both replicas: 3.67 | 6.33 -> 0.79)
    assert r.eplb.layers[1].holdout_after == pytest.approx(5 / 6)
    assert any(n.startswith("layer(s) 0 hold no traffic (0 assignments)") for n in r.notes)

# -- traces: routing sources, padding, bias effect ---------------------------------------------
@pytest.fixture
def bias_trace(make_trace):
    """``t.safetensors``: one layer of 4 rows in 2 steps whose bias changes every pick."""
    # E=4, K=1, sigmoid. Logits [2,1,0,0]: without bias expert 0 wins; bias -1 on expert 0 makes
    # sigmoid(2)-1 = -0.12 < sigmoid(1) = 0.73, so expert 1 wins. Row 3 is padding.
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]] * 4)
    pad = torch.tensor([False, False, False, True])
    bias = torch.tensor([-1.0, 0.0, 0.0, 0.0])
    # production picked 2 once; the padded row holds garbage (3), which must not count anywhere
    recorded = torch.tensor([[1], [1], [2], [3]], dtype=torch.int32)
    layer = LayerArrays(gating_output=logits, bias=bias, is_padding=pad, topk_ids=recorded,
                        step_offsets=torch.tensor([0, 2, 4]))
    return make_trace("t.safetensors", {0: layer}, router=RouterConfig(num_experts=4, topk=1, route_scale=1.0))


def _reference():
    from routetool_kernels.reference import musespark1x_routing_reference

    return musespark1x_routing_reference


def test_trace_reference_routing_with_bias_effect(device, bias_trace):
    path = bias_trace
    with Trace(path) as t:
        ref = route_fn_from(_reference(), t.meta.router)
        src = TraceSource(t, t.layers, routing="reference", route_fn=ref, route_name="reference", nobias_fn=ref)
        r = analyze_balance(src, BalanceOptions(ep_sizes=[2], eplb=None, capacity_factors=[]), device)
    x = r.layers[0]
    assert x.tokens == 3 and x.counts == [0, 3, 0, 0]       # padded row not counted
    b = x.bias
    assert b.counts_with == [0, 3, 0, 0] and b.counts_without == [3, 0, 0, 0]
    assert b.changed_fraction == 1.0
    assert x.phases[0].phase == "decode" and x.phases[0].steps == 2  # small steps, one padded


def test_trace_recorded_routing_keeps_bias_pair_consistent(bias_trace):
    path = bias_trace
    with Trace(path) as t:
        ref = route_fn_from(_reference(), t.meta.router)
        src = TraceSource(t, t.layers, routing="recorded", nobias_fn=ref, nobias_name="reference")
        r = analyze_balance(src, BalanceOptions(ep_sizes=[2], eplb=None, capacity_factors=[]))
    x = r.layers[0]
    assert x.counts == [0, 2, 1, 0]                          # the recorded ids, padded row left out
    assert x.ranks[0].tokens_received == [2, 1]              # not [2, 2]: the padded row sends nothing
    assert x.bias.counts_with == [0, 3, 0, 0]                # bias pair routed by the reference
    assert x.bias.counts_without == [3, 0, 0, 0]
    assert "recorded" in r.routing


def test_ids_only_trace_says_bias_effect_needs_logits(tmp_path, make_trace):
    path = tmp_path / "ids.safetensors"
    make_trace(path, {2: LayerArrays(topk_ids=torch.tensor([[0, 1], [2, 3], [0, 3]], dtype=torch.int32))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    with Trace(path) as t:
        src = TraceSource(t, t.layers)  # auto: recorded ids, no routing function needed
        r = analyze_balance(src, BalanceOptions(ep_sizes=[2], eplb=None))
    assert r.layers[0].counts == [2, 1, 1, 2] and r.layers[0].bias is None
    assert "no logits" in r.bias_note
    with Trace(path) as t, pytest.raises(RouteToolError, match="ids-only trace"):
        TraceSource(t, t.layers, routing="reference", route_fn=route_fn_from(_reference(), t.meta.router))


def test_recorded_routing_needs_recorded_ids(tmp_path, make_trace):
    path = tmp_path / "t.safetensors"
    make_trace(path, {0: LayerArrays(gating_output=torch.zeros(3, 8))})
    with Trace(path) as t, pytest.raises(RouteToolError, match="holds no recorded topk_ids"):
        TraceSource(t, t.layers, routing="recorded")


def test_histogram_total_equals_unpadded_tokens_times_topk(tmp_path):
    # invariant on the bundled synthetic trace (reference routing, CPU)
    from pathlib import Path

    trace = Path(__file__).resolve().parents[2] / "traces" / "musespark1x-synth-bf16.safetensors"
    with Trace(trace) as t:
        ref = route_fn_from(_reference(), t.meta.router)
        src = TraceSource(t, [0], routing="reference", route_fn=ref, route_name="reference", nobias_fn=ref)
        r = analyze_balance(src, BalanceOptions(ep_sizes=[8, 32], eplb=EplbOptions(num_redundant=32)))
    x = r.layers[0]
    assert x.assignments == x.tokens * 8 == sum(x.counts) and x.uncounted == 0
    for rank in x.ranks:
        assert sum(rank.assignments) == pytest.approx(x.assignments)
        assert sum(rank.tokens_received) <= x.tokens * min(8, rank.num_ranks)
    assert sum(x.bias.counts_without) == x.assignments
    assert r.eplb.layers[0].balancedness_after >= r.eplb.layers[0].balancedness_before


@pytest.mark.parametrize("num_ranks", [2, 128])  # both code paths: hit mask (<= 64 ranks) and sort
def test_tokens_per_rank_paths_agree(device, num_ranks):
    g = torch.Generator().manual_seed(num_ranks)
    E = 256
    ids = torch.randint(-1, E, (300, 8), generator=g).to(device)
    rank_of = (torch.arange(E) // (E // num_ranks)).to(device)
    out = tokens_per_rank(ids, rank_of, num_ranks)
    expected = torch.zeros(num_ranks, dtype=torch.int64)
    for row in ids.cpu().tolist():
        for r in {int(rank_of[e]) for e in row if e >= 0}:
            expected[r] += 1
    assert out.cpu().tolist() == expected.tolist()


# -- windows, duplicates, routing functions that misbehave ---------------------------------------
def test_window_tokens_exclude_padded_rows_and_sum_to_the_layer(bias_trace):
    # bias_trace: step 0 has 2 rows, step 1 has 2 rows of which 1 is padding. Windows are cut
    # by rows (2 + 2), but their tokens are unpadded tokens: 2 and 1, summing to the layer's 3.
    path = bias_trace
    with Trace(path) as t:
        src = TraceSource(t, t.layers, routing="recorded", bias_effect=False)
        r = analyze_balance(src, BalanceOptions(ep_sizes=[2], windows=2, eplb=None, capacity_factors=[]))
    x = r.layers[0]
    assert [w.tokens for w in x.windows] == [2, 1]
    assert sum(w.tokens for w in x.windows) == x.tokens == 3
    assert sum(w.assignments for w in x.windows) == x.assignments


def test_window_tokens_of_counts_with_topk_sum_to_the_layer():
    counts = ImportedCounts(source="c", format="counts-json", model="m", num_experts=4, topk=2,
                            layers={0: torch.tensor([[6, 2, 0, 0], [2, 2, 2, 2], [1, 1, 0, 0]])})
    r = analyze_balance(CountsSource(counts), BalanceOptions(ep_sizes=[2], windows=2, eplb=None, capacity_factors=[]))
    x = r.layers[0]
    assert sum(w.tokens for w in x.windows) == x.tokens == 4 + 4 + 1


def test_duplicate_recorded_ids_are_rejected_like_dumps(tmp_path, make_trace):
    # a row [0, 0] used to count expert 0 twice without a word; `import` rejects such rows
    path = tmp_path / "dup.safetensors"
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [3, 3], [0, 3]], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 5]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    with Trace(path) as t, pytest.raises(RouteToolError, match=r"layers.0.topk_ids: layer 0, step 1, row 3: the "
                                                                 r"recorded ids \[3, 3\] hold one expert twice; 1 "
                                                                 r"unpadded row\(s\) of the layer are invalid"):
        analyze_balance(TraceSource(t, t.layers), BalanceOptions(ep_sizes=[2], eplb=None))


@pytest.mark.parametrize("bad_row, words", [
    # ids >= E and -1 on unpadded rows were left out of every count without an error (exit 0,
    # wrong statistics); replay's invalid-row checks and `import` refuse them
    ([0, 9], "the recorded ids [0, 9] hold an id outside [0, 4)"),
    ([-1, 2], "the recorded ids [-1, 2] hold -1 on an unpadded row"),
    ([-1, -1], "the recorded ids [-1, -1] hold -1 on an unpadded row"),
    ([-5, 1], "the recorded ids [-5, 1] hold an id outside [0, 4)"),
])
def test_invalid_recorded_ids_are_bad_input(tmp_path, bad_row, words, make_trace):
    path = tmp_path / "bad.safetensors"
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], bad_row, [0, 3], bad_row], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, step_offsets=torch.tensor([0, 2, 6]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    with Trace(path) as t, pytest.raises(RouteToolError) as info:
        analyze_balance(TraceSource(t, t.layers), BalanceOptions(ep_sizes=[2], eplb=None))
    assert not isinstance(info.value, KernelError) and info.value.exit_code == EXIT_USAGE
    text = str(info.value)
    assert text.startswith(f"{path}: layers.0.topk_ids: layer 0, step 1, row 3: {words}; 2 unpadded row(s)"), text
    assert "\n" not in text


def test_invalid_ids_on_padded_rows_do_not_count(tmp_path, make_trace):
    # padded rows hold anything (-1, ids >= E): they are masked before the check and never counted
    path = tmp_path / "pad.safetensors"
    ids = torch.tensor([[0, 1], [9, -1], [-1, -1], [2, 3]], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, is_padding=torch.tensor([False, True, True, False]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    with Trace(path) as t:
        r = analyze_balance(TraceSource(t, t.layers), BalanceOptions(ep_sizes=[2], eplb=None))
    assert r.layers[0].counts == [1, 1, 1, 1] and r.layers[0].uncounted == 0 and r.layers[0].tokens == 2


def test_invalid_imported_ids_are_refused():
    # an ImportedRouting made by hand (read_dump checks its rows when it reads them)
    ids = torch.tensor([[0, 1], [2, 3], [1, 7]], dtype=torch.int32)
    imported = ImportedRouting(source="hand.jsonl", format="jsonl", model="m", num_experts=4, topk=2,
                               layers={2: ImportedLayer(topk_ids=ids, topk_weights=None, step_offsets=[0, 2, 3])})
    with pytest.raises(RouteToolError, match=r"^hand.jsonl: layer 2, step 1, row 2: the ids \[1, 7\] hold an id "
                                             r"outside \[0, 4\); 1 row\(s\) of the layer are invalid"):
        analyze_balance(ImportedSource(imported), BalanceOptions(ep_sizes=[2], eplb=None))


def test_duplicates_on_padded_rows_do_not_count(tmp_path, make_trace):
    # padded rows hold anything (here [1, 1]); they are masked before the check
    path = tmp_path / "pad.safetensors"
    ids = torch.tensor([[0, 1], [1, 1]], dtype=torch.int32)
    make_trace(path, {0: LayerArrays(topk_ids=ids, is_padding=torch.tensor([False, True]))},
               router=RouterConfig(num_experts=4, topk=2, route_scale=1.0))
    with Trace(path) as t:
        r = analyze_balance(TraceSource(t, t.layers), BalanceOptions(ep_sizes=[2], eplb=None))
    assert r.layers[0].counts == [1, 1, 0, 0]


def _route_with(path, fn, **kw):
    with Trace(path) as t:
        route = route_fn_from(fn, t.meta.router, kernel=True, name="kernel bad")
        src = TraceSource(t, t.layers, routing="kernel", route_fn=route, nobias_fn=route,
                          **({"bias_effect": False} | kw))
        return analyze_balance(src, BalanceOptions(ep_sizes=[2], eplb=None))


def _ids_kernel(make_ids):
    """A kernel (the seed's signature) returning ``make_ids(gating, bias, is_padding)`` and float32 weights."""
    def fn(gating_output, bias, *a, is_padding=None, **k):
        ids = make_ids(gating_output, bias, is_padding)
        w = torch.ones(ids.shape, dtype=torch.float32) if isinstance(ids, torch.Tensor) else None
        return w, ids
    return fn


def _crash(gating, *a, **k):
    raise RuntimeError("device-side assert\nsecond line")


def _exit(gating, *a, **k):
    raise SystemExit(3)


def _scribble(gating, *a, **k):
    gating[0] = float("nan")  # NaN bits differ from the logits' bits
    return torch.zeros(gating.shape[0], 1), torch.zeros(gating.shape[0], 1, dtype=torch.int64)


@pytest.mark.parametrize("fn, words", [
    (_crash, r"kernel bad crashed on layer 0, step 0 \(RuntimeError: device-side assert\)"),
    (_exit, r"kernel bad crashed on layer 0, step 0 \(SystemExit: 3\)"),
    (_ids_kernel(lambda g, b, p: torch.zeros(g.shape[0] - 1, 1, dtype=torch.int64)),
     r"kernel bad returned \(\(1, 1\) float32, \(1, 1\) int64\) on layer 0, step 0; expected \(topk_weights float32 "
     r"\[2, 1\]"),
    (_ids_kernel(lambda g, b, p: torch.zeros(g.shape[0], 2, dtype=torch.int64)), r"\(2, 2\) int64\) on layer 0, step 0; "
                                                                                 r"expected"),
    (_ids_kernel(lambda g, b, p: torch.zeros(g.shape[0], 1)), r"\(2, 1\) float32, \(2, 1\) float32\)"),
    (_ids_kernel(lambda g, b, p: None), r"returned \(NoneType, NoneType\)"),
    (_scribble, r"kernel bad wrote into its input gating_output on layer 0, step 0 \(a routing kernel may write only"),
])
def test_misbehaving_routing_function_is_one_line(fn, words, bias_trace):
    # a kernel returning n-1 rows used to exit 0 with an undercounted load; these are faults of the
    # kernel, exit 1 as in replay and validate (they were exit 2, bad input)
    with pytest.raises(KernelError, match=words) as info:
        _route_with(bias_trace, fn)
    assert "\n" not in str(info.value) and "t.safetensors" in str(info.value)
    assert info.value.exit_code == EXIT_FINDINGS


def _ids_plus(offset):
    def route(gating, bias, pad):
        from routetool_kernels.reference import musespark1x_routing_reference

        return musespark1x_routing_reference(gating, bias, topk=1, route_scale=1.0, is_padding=pad)[1] + offset
    return _ids_kernel(route)


@pytest.mark.parametrize("fn, words", [
    # the reference's ids + 1000, or all -1: left out of every count, exit 0 with wrong statistics
    (_ids_plus(1000), ("returned invalid topk_ids on layer 0, step 0, row 0: [1001] hold an id outside [0, 4); "
                       "3 of the layer's rows are invalid")),
    (_ids_kernel(lambda g, b, p: torch.full((g.shape[0], 1), -1, dtype=torch.int32)),
     "returned invalid topk_ids on layer 0, step 0, row 0: [-1] hold -1 on an unpadded row; 3 of the layer's rows"),
    # step 1's row 3 is padding: only row 2 (the layer's row, as replay counts) is named
    (_ids_kernel(lambda g, b, p: torch.full((g.shape[0], 1), 7 if p is not None and bool(p.any()) else 0,
                                            dtype=torch.int32)),
     "returned invalid topk_ids on layer 0, step 1, row 2: [7] hold an id outside [0, 4); 1 of the layer's rows is"),
])
def test_invalid_ids_from_a_routing_function_are_a_kernel_fault(fn, words, bias_trace):
    with pytest.raises(KernelError) as info:
        _route_with(bias_trace, fn)
    assert words in str(info.value) and info.value.exit_code == EXIT_FINDINGS
    assert info.value.failure_class.startswith("invalid:")


def test_bias_effect_routing_is_checked_too(bias_trace):
    # ids counted for the bias effect (routed again with the bias zeroed) are checked as well
    fn = _ids_kernel(lambda g, b, p: torch.full((g.shape[0], 1), 1 if bool(b.any()) else 4, dtype=torch.int32))
    with pytest.raises(KernelError, match=r"kernel bad returned invalid topk_ids on layer 0, step 0, row 0 "
                                          r"\(bias effect\): \[4\]"):
        _route_with(bias_trace, fn, bias_effect=True)
