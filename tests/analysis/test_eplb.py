"""EPLB (replication + packing), placements, balancedness: hand-computed textbook cases and invariants."""

import json
from pathlib import Path

import pytest
import torch

from routetool.analysis.eplb import (
    balanced_packing,
    balancedness,
    check_eplb_config,
    contiguous_placement,
    load_placement,
    max_redundant,
    placement_document,
    rebalance_experts,
    replicate_experts,
    share_matrix,
)
from routetool.errors import RouteToolError

REALDATA = Path(__file__).resolve().parents[3] / "shared" / "realdata"


def _loads(placement, weights, layer=0):
    return (torch.as_tensor(weights, dtype=torch.float64) @ placement.share_matrix(layer)).tolist()


# -- balancedness ------------------------------------------------------------------------
@pytest.mark.parametrize("loads, expected", [
    ([2, 2, 2, 2], 1.0),          # perfectly even
    ([4, 0, 0, 0], 0.25),         # one rank does everything: 1/N
    ([6, 4], 5 / 6),              # mean 5, max 6
    ([3, 1], 2 / 3),
])
def test_balancedness_by_hand(loads, expected):
    assert balancedness(torch.tensor(loads)).item() == pytest.approx(expected)


def test_balancedness_of_nothing_is_nan_and_batched():
    out = balancedness(torch.tensor([[0, 0], [1, 3]]))
    assert torch.isnan(out[0]) and out[1].item() == pytest.approx(2 / 3)  # mean 2, max 3


def test_share_matrix_splits_replicated_expert_evenly():
    # E=3, P=4 on 2 GPUs: GPU0 = [e0, e1], GPU1 = [e0, e2]; e0 has two replicas
    m = share_matrix(torch.tensor([0, 1, 0, 2]), num_experts=3, num_ranks=2)
    assert m.tolist() == [[0.5, 0.5], [1.0, 0.0], [0.0, 1.0]]
    # expert loads [10, 1, 1] -> GPU loads [5 + 1, 5 + 1]
    assert (torch.tensor([10.0, 1, 1], dtype=torch.float64) @ m).tolist() == [6.0, 6.0]


# -- building blocks ---------------------------------------------------------------------
def test_balanced_packing_textbook():
    # [10,1,1,1] into 2 packs of 2: 10->p0, 1->p1, 1->p1, last 1 -> p0 (p1 full): loads 11 / 2
    pack, rank = balanced_packing(torch.tensor([10.0, 1, 1, 1]), 2)
    assert pack.tolist() == [0, 1, 1, 0] and rank.tolist() == [0, 0, 1, 1]
    # [5,4,3,3,2,1] into 2 packs of 3: 5->p0, 4->p1, 3->p1 (7), 3->p0 (8), 2->p1 (9, full), 1->p0 (9)
    pack, _ = balanced_packing(torch.tensor([5.0, 4, 3, 3, 2, 1]), 2)
    assert pack.tolist() == [0, 1, 1, 0, 1, 0]
    w = torch.tensor([5.0, 4, 3, 3, 2, 1])
    assert [float(w[pack == p].sum()) for p in range(2)] == [9.0, 9.0]


def test_balanced_packing_needs_even_split():
    with pytest.raises(ValueError):
        balanced_packing(torch.tensor([1.0, 2, 3]), 2)


def test_replicate_experts_textbook():
    # [10,1,1,1] to 6 slots: the hot expert gets both extra replicas (10/2=5 is still the max)
    phy, rank, cnt = replicate_experts(torch.tensor([10.0, 1, 1, 1]), 6)
    assert phy.tolist() == [0, 1, 2, 3, 0, 0] and rank.tolist() == [0, 0, 0, 0, 1, 2] and cnt.tolist() == [3, 1, 1, 1]
    # [6,4] to 4 slots: 6 -> 3 per replica, then 4 is the max -> 2 per replica
    phy, _, cnt = replicate_experts(torch.tensor([6.0, 4]), 4)
    assert phy.tolist() == [0, 1, 0, 1] and cnt.tolist() == [2, 2]


# -- rebalance_experts ---------------------------------------------------------------------
def test_global_no_redundancy_textbook():
    p = rebalance_experts(torch.tensor([[10.0, 1, 1, 1]]), 0, num_gpus=2)
    assert p.policy == "global"
    assert p.physical_to_logical.tolist() == [[0, 3, 1, 2]]
    assert _loads(p, [10, 1, 1, 1]) == [11.0, 2.0]


def test_global_with_redundancy_textbook():
    # replicas: e0 x3 (3.33 each) + e1,e2,e3 (1 each) on 2 GPUs of 3 slots:
    # 3.33->g0, 3.33->g1, 3.33->g0, 1->g1, 1->g1 (full), 1->g0 => [7.667, 5.333]
    p = rebalance_experts(torch.tensor([[10.0, 1, 1, 1]]), 2, num_gpus=2)
    assert p.physical_to_logical.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert p.logical_count.tolist() == [[3, 1, 1, 1]]
    loads = _loads(p, [10, 1, 1, 1])
    assert loads == pytest.approx([23 / 3, 16 / 3])
    assert balancedness(torch.tensor(loads)).item() == pytest.approx(6.5 / (23 / 3))
    l2p = p.logical_to_physical()[0].tolist()
    assert l2p == [[0, 3, 1], [4, -1, -1], [5, -1, -1], [2, -1, -1]]


def test_hierarchical_textbook():
    # groups of 2: {0,1}=15, {2,3}=2, {4,5}=11, {6,7}=4; groups onto 2 nodes: 15->n0, 11->n1, 4->n1, 2->n0
    # node0 [8,7,1,1] onto 2 GPUs: 8|7, 1->gpu1 (8), 1->gpu0 (9); node1 [6,5,2,2]: 6|5, 2->gpu3, 2->gpu2
    w = torch.tensor([[8.0, 7, 1, 1, 6, 5, 2, 2]])
    p = rebalance_experts(w, 0, num_gpus=4, num_nodes=2, num_groups=4)
    assert p.policy == "hierarchical"
    assert p.physical_to_logical.tolist() == [[0, 3, 1, 2, 4, 7, 5, 6]]
    assert _loads(p, w[0]) == [9.0, 8.0, 8.0, 7.0]
    # 4 redundant (2 per node): node0 replicates 8 then 7 -> [4,3.5,1,1,4,3.5] -> 8.5 | 8.5
    # node1 replicates 6 then 5 -> [3,2.5,2,2,3,2.5] -> 7.5 | 7.5
    p = rebalance_experts(w, 4, num_gpus=4, num_nodes=2, num_groups=4)
    assert p.logical_count.tolist() == [[2, 2, 1, 1, 2, 2, 1, 1]]
    assert _loads(p, w[0]) == pytest.approx([8.5, 8.5, 7.5, 7.5])


def test_hierarchical_keeps_groups_on_one_node():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 64, generator=g) ** 4 * 1000
    p = rebalance_experts(w, 16, num_gpus=8, num_nodes=4, num_groups=8)
    per_node = p.num_physical // 4
    for i in range(3):
        for node in range(4):
            slots = p.physical_to_logical[i, node * per_node:(node + 1) * per_node]
            groups = set((slots // 8).tolist())
            assert len(groups) == 2, "a node must hold exactly its two whole groups"


@pytest.mark.parametrize("E, R, G, nodes, groups", [
    (8, 0, 8, 1, 1),      # one expert per GPU, nothing to move
    (60, 4, 4, 1, 1),     # Qwen1.5-MoE shape, non-power-of-2 E
    (64, 16, 8, 2, 8),    # hierarchical, DeepSeek-like groups
    (256, 32, 32, 4, 8),  # DeepSeek-V3 deployment shape
])
def test_placement_invariants(E, R, G, nodes, groups):
    g = torch.Generator().manual_seed(E + R)
    w = (torch.rand(2, E, generator=g) ** 3) * 1e4
    p = rebalance_experts(w, R, num_gpus=G, num_nodes=nodes, num_groups=groups)
    P = E + R
    assert p.physical_to_logical.shape == (2, P)
    for i in range(2):
        phy, cnt = p.physical_to_logical[i], p.logical_count[i]
        assert (cnt >= 1).all() and int(cnt.sum()) == P
        assert torch.equal(torch.bincount(phy, minlength=E), cnt)
        for e in range(E):  # replica ranks of each expert are 0..c-1
            ranks = sorted(p.replica_rank[i][phy == e].tolist())
            assert ranks == list(range(int(cnt[e])))
        loads = torch.as_tensor(w[i], dtype=torch.float64) @ p.share_matrix(i)
        assert float(loads.sum()) == pytest.approx(float(w[i].sum()))
        # the hottest GPU is never worse than the hottest replica alone forces, nor than the
        # contiguous placement (greedy on these loads)
        contiguous = torch.as_tensor(w[i], dtype=torch.float64) @ contiguous_placement([0], E, G).share_matrix(0)
        assert float(loads.max()) <= float(contiguous.max()) + 1e-9
        assert float(loads.max()) >= float((w[i] / cnt).max()) - 1e-9


def test_uniform_load_is_perfect_after_eplb():
    p = rebalance_experts(torch.full((1, 16), 100.0), 0, num_gpus=4)
    assert balancedness(torch.tensor(_loads(p, [100.0] * 16))).item() == pytest.approx(1.0)


@pytest.mark.parametrize("E, R, G, nodes, groups, policy, words", [
    (8, 1, 4, 1, 1, "auto", "multiple of the 4 GPUs"),
    (8, 0, 4, 3, 1, "auto", "multiple of the 3 nodes"),
    (8, 0, 4, 1, 3, "auto", "multiple of the 3 expert groups"),
    (8, 0, 4, 4, 2, "hierarchical", "cannot be split over 4 nodes"),
])
def test_impossible_configs_are_route_tool_errors(E, R, G, nodes, groups, policy, words):
    with pytest.raises(RouteToolError, match=words):
        check_eplb_config(E, R, groups, nodes, G, policy)


@pytest.mark.parametrize("E, R, G", [
    (60, 100_000_000, 4),       # a typo: ran for hours, one slot at a time (10^6 took 54 s)
    (60, 99_999_940, 60),       # passes the divisibility check (10^8 slots over 60 GPUs)
    (60, 181, 1),               # one over the limit (3 per logical expert)
])
def test_redundant_over_the_limit_is_refused_first(E, R, G):
    with pytest.raises(RouteToolError) as info:
        check_eplb_config(E, R, 1, 1, G, "auto")
    assert str(info.value) == (f"EPLB: --redundant {R} is over the limit of 180 redundant experts (3 per logical "
                               "expert, 60 experts) (pass --redundant 180 or fewer; deployments replicate a "
                               "fraction of the experts)")


def test_redundant_implied_by_the_gpus_names_the_gpus():
    # --gpus 1000 alone said '--redundant 1000 is over the limit', an option the user never gave
    with pytest.raises(RouteToolError) as info:
        check_eplb_config(60, 1000, 1, 1, 1000, "auto", redundant_implied_by="--gpus")
    assert str(info.value) == ("EPLB: --gpus 1000 implies --redundant 1000 by default (one redundant expert per GPU), "
                               "over the limit of 180 redundant experts (3 per logical expert, 60 experts) (pass fewer "
                               "--gpus, or an explicit --redundant of at most 180)")
    with pytest.raises(RouteToolError, match=r"240 physical experts \(60 \+ 180 redundant, one per GPU by default\) "
                                             "must be a multiple of the 180 GPUs"):
        check_eplb_config(60, 180, 1, 1, 180, "auto", redundant_implied_by="--gpus")


def test_redundant_at_the_limit_is_accepted():
    assert max_redundant(60) == 180
    assert check_eplb_config(60, 180, 1, 1, 4, "auto") == "global"
    p = rebalance_experts(torch.tensor([[4.0, 2, 1, 1]]), max_redundant(4), num_gpus=4)
    assert p.num_physical == 16 and p.logical_count.sum().item() == 16


def test_auto_policy_rule():
    assert check_eplb_config(64, 0, 8, 2, 8, "auto") == "hierarchical"
    assert check_eplb_config(64, 0, 8, 1, 8, "auto") == "global"   # one node: the policies coincide
    assert check_eplb_config(64, 0, 1, 2, 8, "auto") == "global"   # groups not divisible by nodes


def test_contiguous_placement():
    p = contiguous_placement([3, 5], 8, 4)
    assert p.rank_of_expert(5).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert _loads(p, [1, 2, 3, 4, 5, 6, 7, 8], layer=3) == [3.0, 7.0, 11.0, 15.0]
    with pytest.raises(RouteToolError, match="cannot be split evenly"):
        contiguous_placement([0], 60, 8)


# -- placement files ------------------------------------------------------------------------
def test_placement_json_roundtrip(tmp_path):
    w = torch.tensor([[10.0, 1, 1, 1], [1.0, 1, 1, 10]])
    p = rebalance_experts(w, 2, num_gpus=2, layers=[4, 9])
    doc = placement_document(p)
    assert doc["schema"] == "routetool.placement/1" and doc["num_physical_experts"] == 6
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(doc))
    q = load_placement(path, 4, [9, 4])
    assert q.physical_to_logical.tolist() == [p.physical_to_logical[1].tolist(), p.physical_to_logical[0].tolist()]
    assert q.num_gpus == 2 and q.logical_count.tolist() == [[1, 1, 1, 3], [3, 1, 1, 1]]
    assert _loads(q, [10, 1, 1, 1], layer=4) == pytest.approx([23 / 3, 16 / 3])


@pytest.mark.parametrize("doc, layers, words", [
    ({"physical_to_logical_map": [[0, 1, 2, 2]], "num_gpus": 2}, [0], "expert 3 has no physical slot"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 3}, [0], "not a multiple of num_gpus=3"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "layers": [1], "num_gpus": 2}, [0], "no placement for layer"),
    ({"physical_to_logical_map": [[0, 1, 2, 7]], "num_gpus": 2}, [0], "outside"),
    ({"placement": []}, [0], "no physical_to_logical_map"),
    # types and values are checked one by one, with the key and element named
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": True}, [0], "num_gpus is true; expected a positive integer"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 0}, [0], "num_gpus is 0; expected a positive integer"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2.0}, [0], "num_gpus is 2.0"),
    ({"physical_to_logical_map": [[0, 0.5, 2, 3]], "num_gpus": 2}, [0], r"physical_to_logical_map\[0\]\[1\] is 0.5"),
    ({"physical_to_logical_map": [[0, True, 2, 3]], "num_gpus": 2}, [0], r"\[0\]\[1\] is true"),
    ({"physical_to_logical_map": [[0, 1, 2, -1]], "num_gpus": 2}, [0], r"\[0\]\[3\] is -1: outside"),
    ({"physical_to_logical_map": [[0, 1, 2, 3], [0, 1]], "num_gpus": 2}, [0], "different lengths"),
    ({"physical_to_logical_map": "0,1,2,3", "num_gpus": 2}, [0], "not a non-empty list"),
    ({"physical_to_logical_map": [0, 1, 2, 3], "num_gpus": 2}, [0], "one flat list of 4 values; expected one list"),
    ({"physical_to_logical_map": [0, [1, 2, 3, 0]], "num_gpus": 2}, [0], "not a non-empty list"),
    ({"schema": "other/9", "physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2}, [0],
     'schema is "other/9"; expected "routetool.placement/1"'),
    ({"schema": None, "physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2}, [0], "schema is null; expected"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "layers": ["a"], "num_gpus": 2}, [0], "'layers' is"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "layers": 0, "num_gpus": 2}, [0], "'layers' is"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2, "num_nodes": "x"}, [0], "num_nodes is"),
    ({"physical_to_logical_map": [[0, 1, 2, 3]]}, [0], "does not say num_gpus"),
    # the --redundant limit holds for a file too (3 per logical expert: 4 + 12 = 16 slots)
    ({"physical_to_logical_map": [[0, 1, 2, 3] * 4 + [0]], "num_gpus": 1}, [0],
     r"has 17 slots per layer for 4 experts: over the limit of 12 redundant experts \(3 per logical expert\) "
     r"\(use a placement with at most 16 slots per layer\)"),
])
def test_bad_placement_files(tmp_path, doc, layers, words):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(RouteToolError, match=words) as info:
        load_placement(path, 4, layers)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_placement_with_a_key_twice_is_refused(tmp_path):
    # json.loads kept the last value: the file's author may have meant the first
    path = tmp_path / "p.json"
    path.write_text('{"physical_to_logical_map": [[0, 1, 2, 3]], "num_gpus": 2, "num_gpus": 4}')
    with pytest.raises(RouteToolError, match="the key 'num_gpus' appears twice in one object") as info:
        load_placement(path, 4, [0])
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_placement_file_not_json(tmp_path):
    path = tmp_path / "p.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(RouteToolError, match="line 1: not UTF-8 text"):
        load_placement(path, 4, [0])


def test_single_row_placement_applies_to_every_layer(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[3, 2, 1, 0]]}))
    q = load_placement(path, 4, [0, 1, 2], num_gpus=2)
    assert q.rank_of_expert(2).tolist() == [1, 1, 0, 0]


# -- on real counts (../shared/realdata), when present ---------------------------------------
@pytest.mark.skipif(not (REALDATA / "expert-counts.olmoe-paper.json").exists(), reason="../shared/realdata not present")
def test_eplb_on_real_olmoe_counts():
    from routetool.io.dumps import ImportOptions, read_counts_json

    counts = read_counts_json(REALDATA / "expert-counts.olmoe-paper.json", ImportOptions(select="olmoe-1b-7b-0924"))
    layers = sorted(counts.layers)
    w = torch.stack([counts.layers[x].sum(0) for x in layers]).double()
    before = contiguous_placement(layers, 64, 8)
    after = rebalance_experts(w, 8, num_gpus=8, layers=layers)
    for i, layer in enumerate(layers):
        b = balancedness(w[i] @ before.share_matrix(layer)).item()
        a = balancedness(w[i] @ after.share_matrix(layer)).item()
        assert 0.7 < b < 0.9      # OLMoE is skewed: a contiguous 8-way split is clearly uneven
        assert a > 0.98 and a > b  # 8 redundant experts nearly flatten it
