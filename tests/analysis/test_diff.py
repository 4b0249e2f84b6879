"""`routetool diff A B`: every measure against a hand-computed case, the verdict and exit codes,
sources that cannot be aligned, and an engine's output against a trace."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from routetool.cli import main
from routetool.io.trace import LayerArrays, RouterConfig
from tests.dump_writers import (
    routed_experts, sglang_generate, vllm_completion, write_flashinfer_workload, write_json, write_jsonl,
    write_megatron_replay, write_vllm_npy,
)

ROUTER = RouterConfig(num_experts=4, topk=2, route_scale=1.0)
ULP_04 = 2.0 ** -25  # the float32 ulp at 0.4 (0.25 <= 0.4 < 0.5)


def run(*args):
    return CliRunner().invoke(main, ["diff", *map(str, args), "--no-progress"], catch_exceptions=False)


def _layer(ids, weights, logits, pad=None):
    n = len(ids)
    return LayerArrays(gating_output=torch.tensor(logits, dtype=torch.float32),
                       topk_ids=torch.tensor(ids, dtype=torch.int32),
                       topk_weights=torch.tensor(weights, dtype=torch.float32),
                       is_padding=torch.tensor(pad or [False] * n),
                       step_offsets=torch.tensor([0, n], dtype=torch.int64))


# Six tokens of E=4, K=2; both sides record ids and weights, and hold the same logits (for ties).
LOGITS = [[4, 3, 0, -1], [4, 3, 0, -1], [4, 3, 0, -1], [4, -1, 1, 1], [4, 3, 0, -1], [0, 0, 0, 0]]
PAD = [False] * 5 + [True]
IDS_A = [[0, 1], [0, 1], [0, 1], [0, 2], [0, 1], [-1, -1]]
W_A = [[0.6, 0.4]] * 5 + [[0.0, 0.0]]
IDS_B = [[0, 1],  # same
         [1, 0],  # slot-order flip (weights swapped with the ids: no weight delta)
         [0, 1],  # weights only: 1 ulp at 0.4
         [0, 3],  # other experts inside a near-tie: logits of experts 2 and 3 equal
         [2, 3],  # other experts outside a near-tie: overlap 0
         [-1, -1]]  # padded on both sides: not compared
W_B = [[0.6, 0.4], [0.4, 0.6], [0.6, 0.4 + ULP_04], [0.6, 0.4], [0.6, 0.4], [0.0, 0.0]]


@pytest.fixture
def hand(make_trace):
    a = make_trace("a.safetensors", {0: _layer(IDS_A, W_A, LOGITS, PAD), 1: _layer(IDS_A, W_A, LOGITS, PAD)},
                   router=ROUTER)
    b = make_trace("b.safetensors", {0: _layer(IDS_B, W_B, LOGITS, PAD), 1: _layer(IDS_A, W_A, LOGITS, PAD)},
                   router=ROUTER)
    return a, b


def test_each_measure_matches_the_hand_computed_case(hand, tmp_path):
    a, b = hand
    js = tmp_path / "d.json"
    res = run(a, b, "--json", js)
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[0] == "DIFFERENT (4 of 10 token-layers; 1 outside near-ties)"
    doc = json.loads(js.read_text())
    l0, l1 = doc["layers"]
    assert l0["classes"] == {"same": 1, "weights": 1, "order": 1, "tie": 1, "real": 1}
    assert (l0["rows"], l0["padded_rows"]) == (5, 1)
    assert l0["set_agreement"] == pytest.approx(3 / 5)  # rows 0, 1, 2 hold the same set
    assert l0["agreement"] == pytest.approx(1 / 5)
    assert l0["overlap_at_k"] == pytest.approx((2 + 2 + 2 + 1 + 0) / 10)
    assert l0["slot_order_flips"] == 1 and l0["near_tie_differences"] == 1 and l0["real_differences"] == 1
    assert l0["weight_rows"] == 3
    assert l0["weight_max_abs_delta"] == pytest.approx(ULP_04, rel=1e-6)
    assert l0["weight_max_delta_ulps"] == pytest.approx(1.0)
    assert l0["weight_mean_abs_delta"] == pytest.approx(ULP_04 / 6, rel=1e-6)  # one of 3 rows x 2 weights
    assert l0["first_divergence_tokens"] == 4
    assert l1["classes"] == {"same": 5, "weights": 0, "order": 0, "tie": 0, "real": 0}
    assert l1["agreement"] == 1.0 and l1["first_divergence_tokens"] == 0
    o = doc["overall"]
    assert (o["token_layers"], o["differing"], o["outside_near_ties"]) == (10, 4, 1)
    assert (o["tokens"], o["tokens_differing"]) == (5, 4)
    assert o["ties_judged"] is True
    assert doc["verdict"] == "different" and doc["exit_code"] == 1
    first = doc["first_differing_rows"][0]
    assert (first["layer"], first["step"], first["row"], first["class"]) == (0, 0, 1, "order")
    assert first["ids_a"] == [0, 1] and first["ids_b"] == [1, 0]
    # tokens 1-4 differ, each first (and only) in layer 0
    fd = doc["first_divergence"]
    assert fd["tokens_differing"] == 4
    assert [(x["token"], x["step"], x["row"], x["layer"]) for x in fd["listed"]] == [(t, 0, t, 0) for t in (1, 2, 3, 4)]
    # margins at the k-th pick (K=2), in ulps of the k-th key: row 3 picks 2 or 3, whose keys are equal
    # (sigmoid(1), an exact tie: bin 0); row 4's exclusive experts reach down to expert 3, key sigmoid(-1),
    # 0.68 below the k-th key sigmoid(3) ~ 0.95 whose ulp is 2^-24: ~1.1e7 ulps, the last bin
    m = doc["margins"]
    assert (m["near_tie"], m["real"], m["not_judged"]) == (1, 1, 0)
    assert m["bins"][0] == {"low_ulps": 0.0, "high_ulps": 0.0, "tie": 1, "real": 0}
    assert m["bins"][-1] == {"low_ulps": 2.0 ** 20, "high_ulps": None, "tie": 0, "real": 1}
    assert sum(b["tie"] + b["real"] for b in m["bins"][1:-1]) == 0


def test_tie_ulps_zero_takes_exact_ties_only(tmp_path, make_trace):
    # experts 2 and 3: logits 1 and 1 + 2^-20, keys 2 float32 ulps apart in float32
    # (ulp 2^-24 at sigmoid(1) ~ 0.73): inside the default 16, outside 1 and 0 (exact ties only)
    logits = [[4, -1, 1, 1 + 2 ** -20]]
    a = make_trace("a.safetensors", {0: _layer([[0, 3]], [[0.6, 0.4]], logits)}, router=ROUTER)
    b = make_trace("b.safetensors", {0: _layer([[0, 2]], [[0.6, 0.4]], logits)}, router=ROUTER)
    doc_path = tmp_path / "d.json"
    assert run(a, b, "--json", doc_path, "--tie-ulps", 0).exit_code == 1
    assert json.loads(doc_path.read_text())["overall"]["classes"]["real"] == 1
    assert run(a, b, "--json", doc_path, "--tie-ulps", 1, "--force").exit_code == 1
    assert json.loads(doc_path.read_text())["overall"]["classes"]["real"] == 1
    bins = json.loads(doc_path.read_text())["margins"]["bins"]
    assert [(b["low_ulps"], b["high_ulps"], b["real"]) for b in bins if b["real"]] == [(1.0, 4.0, 1)]  # 2 ulps
    res = run(a, b, "--json", doc_path, "--force")
    assert res.output.splitlines()[0] == "DIFFERENT (1 of 1 token-layers; 0 outside near-ties)"
    doc = json.loads(doc_path.read_text())
    assert doc["overall"]["classes"]["tie"] == 1
    assert [(b["low_ulps"], b["high_ulps"], b["tie"]) for b in doc["margins"]["bins"] if b["tie"]] == [(1.0, 4.0, 1)]
    assert run(a, b, "--ignore-ties").exit_code == 0


def test_thresholds_turn_tolerated_differences_into_exit_0(hand, tmp_path):
    a, b = hand
    assert run(a, b, "--ignore-ties", "--ignore-order").exit_code == 1  # weights + real left
    assert run(a, b, "--ignore-ties", "--ignore-order", "--weight-ulps", 1).exit_code == 1  # real left
    res = run(a, b, "--ignore-ties", "--ignore-order", "--weight-ulps", 1, "--max-flip-rate", 0.1)
    assert res.exit_code == 0, res.output  # 1 counted of 10 token-layers
    assert res.output.startswith("DIFFERENT (3 of 10 token-layers; 1 outside near-ties): within the thresholds")
    assert run(a, b, "--max-flip-rate", 0.39).exit_code == 1  # 4 of 10
    assert run(a, b, "--max-flip-rate", 0.4).exit_code == 0


def test_details_prints_every_layer_and_the_first_differing_rows(hand):
    res = CliRunner().invoke(main, ["diff", str(hand[0]), str(hand[1]), "--details", "--no-progress"],
                             terminal_width=200)
    assert "Agreement by layer" in res.output and "First differing rows" in res.output
    assert "order" in res.output and "real" in res.output
    assert "First divergence by token (first 4 of 4 tokens differing)" in res.output
    lines = res.output.splitlines()
    assert any(line.split() == ["0", "(exact", "tie)", "1", "0"] for line in lines)  # the margins, as in the JSON
    assert any(line.split() == [">", "1,048,576", "0", "1"] for line in lines)


@pytest.fixture
def logits_trace(make_trace):
    """``logits_trace(path, bias, seed=0) -> Path``: 3 layers of random logits (40 tokens in steps of 16
    and 24, E=16, K=4, route_scale 2.5) under the ``[16]`` ``bias``, no recorded outputs."""
    def make(path, bias, seed=0):
        g = torch.Generator().manual_seed(seed)
        router = RouterConfig(num_experts=16, topk=4, route_scale=2.5)
        layers = {i: LayerArrays(gating_output=torch.randn(40, 16, generator=g), bias=bias,
                                 step_offsets=torch.tensor([0, 16, 40])) for i in range(3)}
        return make_trace(path, layers, router=router)
    return make


def test_a_trace_against_itself_is_identical(logits_trace):
    t = logits_trace("t.safetensors", torch.zeros(16))
    res = run(t, t)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == "IDENTICAL (120 token-layers, 3 layers)"


def test_the_same_logits_under_another_bias_differ_per_layer(tmp_path, logits_trace):
    a = logits_trace("a.safetensors", torch.zeros(16))
    b = logits_trace("b.safetensors", torch.linspace(-0.3, 0.3, 16))
    js = tmp_path / "d.json"
    res = run(a, b, "--json", js)
    assert res.exit_code == 1, res.output
    assert res.output.startswith("DIFFERENT (")
    doc = json.loads(js.read_text())
    assert [x["layer"] for x in doc["layers"]] == [0, 1, 2]
    assert all(0 <= x["agreement"] < 1 for x in doc["layers"])
    assert doc["overall"]["outside_near_ties"] > 0  # a bias moves picks far beyond a near-tie
    assert doc["overall"]["tokens_differing"] > 0


def test_json_to_stdout_and_a_plot(tmp_path, logits_trace):
    pytest.importorskip("matplotlib")
    t = logits_trace("t.safetensors", torch.zeros(16))
    png = tmp_path / "agree.png"
    res = CliRunner().invoke(main, ["diff", str(t), str(t), "--json", "-", "--plot", str(png), "--no-progress"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["verdict"] == "identical"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["steps", "layers", "topk"])
def test_sources_that_cannot_be_aligned_are_refused_in_one_line(case, logits_trace, make_trace):
    a = logits_trace("a.safetensors", torch.zeros(16))
    g = torch.randn(40, 16)
    if case == "steps":  # the same 40 tokens, cut into other steps
        layers = {i: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 20, 40])) for i in range(3)}
        router, why = RouterConfig(num_experts=16, topk=4, route_scale=2.5), "step 0 holds 16 tokens in A, 20 in B"
    elif case == "layers":
        layers = {i: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 16, 40])) for i in range(2)}
        router, why = RouterConfig(num_experts=16, topk=4, route_scale=2.5), "different layers"
    else:
        layers = {i: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 16, 40])) for i in range(3)}
        router, why = RouterConfig(num_experts=16, topk=2, route_scale=2.5), "A routes top-4, B top-2"
    b = make_trace("b.safetensors", layers, router=router)
    res = CliRunner().invoke(main, ["diff", str(a), str(b), "--no-progress"])
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("routetool: error: ") and why in lines[0]
    if case == "steps":  # the same tokens per layer: aligned by row alone
        assert run(a, b, "--align", "rows").exit_code == 1
    if case == "layers":
        assert run(a, b, "--layers", "0,1").exit_code == 1


def test_a_vllm_output_against_an_ids_only_trace(tmp_path, make_trace):
    arr = routed_experts(tokens=12, layers=2, topk=2, experts=8, seed=3)
    npy = write_vllm_npy(tmp_path / "req.npy", arr)
    ids = torch.from_numpy(arr.astype("int64")).to(torch.int32)
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)

    def trace(name, layer0):
        layers = {0: LayerArrays(topk_ids=layer0, step_offsets=torch.tensor([0, 12])),
                  1: LayerArrays(topk_ids=ids[:, 1].contiguous(), step_offsets=torch.tensor([0, 12]))}
        return make_trace(name, layers, router=router)

    same = trace("same.safetensors", ids[:, 0].contiguous())
    res = run(npy, same)
    assert res.exit_code == 0, res.output
    assert res.output.startswith("IDENTICAL (24 token-layers, 2 layers)")
    other = ids[:, 0].clone()
    other[5] = other[5].flip(0)  # one slot-order flip at token 5 of layer 0
    js = tmp_path / "d.json"
    res = run(npy, trace("other.safetensors", other), "--json", js)
    assert res.exit_code == 1
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"]["order"] == 1 and doc["overall"]["ties_judged"] is False
    assert doc["first_differing_rows"][0]["row"] == 5


def test_a_near_tie_of_either_routing_counts(tmp_path, make_trace):
    # A's keys: expert 3 (logit 1.5) well above expert 2 (logit 1); B's keys: 2 and 3 tied exactly (as
    # bf16 rounding makes them). B picked 2, A picked 3: a difference at B's knife edge
    a = make_trace("a.safetensors", {0: _layer([[0, 3]], [[0.6, 0.4]], [[4, -1, 1, 1.5]])}, router=ROUTER)
    b = make_trace("b.safetensors", {0: _layer([[0, 2]], [[0.6, 0.4]], [[4, -1, 1, 1]])}, router=ROUTER)
    js = tmp_path / "d.json"
    assert run(a, b, "--json", js).exit_code == 1
    assert json.loads(js.read_text())["overall"]["classes"]["tie"] == 1
    c = make_trace("c.safetensors", {0: _layer([[0, 2]], [[0.6, 0.4]], [[4, -1, 1, 1.25]])}, router=ROUTER)
    assert run(a, c, "--json", js, "--force").exit_code == 1  # neither routing is at a tie there
    assert json.loads(js.read_text())["overall"]["classes"]["real"] == 1


def test_run_folders_are_aligned_rank_by_rank(tmp_path, logits_trace):
    def run_folder(name, bias1):
        for r in (0, 1):
            (tmp_path / name / f"rank-{r}").mkdir(parents=True)
            logits_trace(tmp_path / name / f"rank-{r}" / "trace.safetensors", bias1 if r else torch.zeros(16), seed=r)
        return tmp_path / name

    a = run_folder("a", torch.zeros(16))
    b = run_folder("b", torch.linspace(-0.3, 0.3, 16))
    js = tmp_path / "d.json"
    assert run(a, a).exit_code == 0
    res = run(a, b, "--json", js)
    assert res.exit_code == 1
    doc = json.loads(js.read_text())
    assert doc["overall"]["token_layers"] == 2 * 3 * 40
    assert {e["rank"] for e in doc["first_differing_rows"]} == {1}  # rank 0 routes alike in both
    one = CliRunner().invoke(main, ["diff", str(a), str(a / "rank-0" / "trace.safetensors"), "--no-progress"])
    assert one.exit_code == 2 and "A holds ranks 0,1, B one trace" in one.stderr


def test_two_engine_outputs_are_aligned_by_request(tmp_path):
    arrs = [routed_experts(tokens=5, layers=2, topk=2, experts=8, seed=s) for s in (1, 2)]
    for folder, names in (("x", ("req-a", "req-b")), ("y", ("req-a", "req-b")), ("z", ("req-a", "req-c"))):
        (tmp_path / folder).mkdir()
        for name, arr in zip(names, arrs):
            write_vllm_npy(tmp_path / folder / f"{name}.npy", arr)
    js = tmp_path / "d.json"
    assert run(tmp_path / "x", tmp_path / "y", "--json", js).exit_code == 0
    assert json.loads(js.read_text())["align"] == "requests"
    res = CliRunner().invoke(main, ["diff", str(tmp_path / "x"), str(tmp_path / "z"), "--no-progress"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    # req-a's 5 tokens are in both; req-b's 5 only in A, req-c's 5 only in B
    assert ("the token sets differ: layer 0: 5 of A's 10 tokens are not in B (first: request 'req-b' position 0); "
            "5 of B's 10 tokens are not in A (first: request 'req-c' position 0)") in res.stderr
    # by step (explicitly), the labels must match step by step
    res = CliRunner().invoke(main, ["diff", str(tmp_path / "x"), str(tmp_path / "z"), "--align", "steps",
                                    "--no-progress"])
    assert res.exit_code == 2 and "step 1 is request 'req-b' in A, 'req-c' in B" in res.stderr
    assert run(tmp_path / "x", tmp_path / "z", "--align", "rows").exit_code == 0  # by row alone: the same arrays


def _responses(path, order, arrays, flip=None):
    """vLLM responses, one per line, of requests ``order`` (ids into ``arrays``); ``flip``: (request,
    token, layer) whose two slots are swapped."""
    docs = []
    for r in order:
        a = arrays[r].copy()
        if flip is not None and flip[0] == r:
            a[flip[1], flip[2]] = a[flip[1], flip[2]][::-1]
        docs.append(vllm_completion([a], request_id=f"cmpl-{r}"))
    return write_jsonl(path, docs)


def test_requests_in_another_order_are_aligned_by_request_and_position(tmp_path):
    # three requests of 3, 5 and 4 tokens; B returns them in another order: by step the sizes differ
    arrays = [routed_experts(tokens=n, layers=2, topk=2, experts=8, seed=n) for n in (3, 5, 4)]
    a = _responses(tmp_path / "a.jsonl", [0, 1, 2], arrays)
    b = _responses(tmp_path / "b.jsonl", [2, 0, 1], arrays)
    js = tmp_path / "d.json"
    res = run(a, b, "--json", js)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == "IDENTICAL (24 token-layers, 2 layers)"
    steps = CliRunner().invoke(main, ["diff", str(a), str(b), "--align", "steps", "--no-progress"])
    assert steps.exit_code == 2 and "step 0 holds 3 tokens in A, 4 in B" in steps.stderr
    # one slot-order flip in request 1 (A's step 1), token 2, layer 1: found at A's row 3 + 2 = 5
    c = _responses(tmp_path / "c.jsonl", [2, 1, 0], arrays, flip=(1, 2, 1))
    res = run(a, c, "--json", js, "--force")
    assert res.exit_code == 1
    assert res.output.splitlines()[0] == "DIFFERENT (1 of 24 token-layers; 0 outside near-ties)"
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"]["order"] == 1
    e = doc["first_differing_rows"][0]
    assert (e["layer"], e["step"], e["row"], e["request"], e["position"]) == (1, 1, 2, "cmpl-1/0", 2)
    assert e["ids_b"] == e["ids_a"][::-1]
    first = doc["first_divergence"]
    assert first["tokens_differing"] == 1 and first["listed"] == [
        {"rank": None, "token": 5, "step": 1, "row": 2, "request": "cmpl-1/0", "position": 2, "layer": 1}]


def test_sources_that_share_no_token_or_name_no_requests(tmp_path, make_trace):
    arrays = [routed_experts(tokens=4, layers=2, topk=2, experts=8, seed=s) for s in (1, 2)]
    a = write_jsonl(tmp_path / "a.jsonl", [vllm_completion([arrays[0]], request_id="one")])
    b = write_jsonl(tmp_path / "b.jsonl", [vllm_completion([arrays[1]], request_id="two")])
    res = CliRunner().invoke(main, ["diff", str(a), str(b), "--no-progress"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "the sources share no token (layer 0: A holds requests 'one/0', B 'two/0')" in res.stderr
    assert "--align rows" in res.stderr
    assert run(a, b, "--align", "rows").exit_code == 1  # by order alone: 4 tokens each, other ids
    ids = torch.from_numpy(arrays[0].astype("int64")).to(torch.int32)
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
    t = make_trace(tmp_path / "t.safetensors", {i: LayerArrays(topk_ids=ids[:, i].contiguous(),
                                                               step_offsets=torch.tensor([0, 4])) for i in range(2)},
                   router=router)
    res = CliRunner().invoke(main, ["diff", str(a), str(t), "--align", "requests", "--no-progress"])
    assert res.exit_code == 2 and "cannot be aligned by request: B (trace) names no requests" in res.stderr
    assert run(a, t).exit_code == 0  # auto: by step where one side names no requests


def test_a_counts_dump_is_refused_for_balance(tmp_path, logits_trace):
    counts = write_json(tmp_path / "counts.json", {"0": {"0": 3, "1": 5}})
    t = logits_trace(tmp_path / "t.safetensors", torch.zeros(16))
    res = CliRunner().invoke(main, ["diff", str(counts), str(t), "--no-progress"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "holds per-expert counts, not per-token routing" in res.stderr and "routetool balance" in res.stderr


def test_each_path_is_classified_once(tmp_path, monkeypatch, logits_trace):
    import routetool.io.inputs as inputs

    calls = []
    real = inputs.classify
    monkeypatch.setattr(inputs, "classify", lambda p, **kw: calls.append(str(p)) or real(p, **kw))
    arr = routed_experts(tokens=6, layers=2, topk=2, experts=8, seed=3)
    npy = write_vllm_npy(tmp_path / "req.npy", arr)
    t = logits_trace(tmp_path / "t.safetensors", torch.zeros(16))
    from routetool.analysis.diff import Source

    for path in (npy, t):
        Source(path, "A").close()
    assert calls == [str(npy), str(t)]


KERNEL = '''
from routetool_kernels.reference import musespark1x_routing_reference


def swapped(gating_output, bias, topk, route_scale, router_output_multiplier=None, router_score_normalization="sigmoid",
            router_score_division_eps=None, topk_weights=None, topk_ids=None, *, is_padding=None):
    """The reference with its first two slots swapped (float32 logits)."""
    w, ids = musespark1x_routing_reference(gating_output, bias, topk=topk, route_scale=route_scale,
                                           router_output_multiplier=router_output_multiplier,
                                           router_score_normalization=router_score_normalization,
                                           router_score_division_eps=router_score_division_eps, is_padding=is_padding)
    return w[:, [1, 0, 2, 3]].contiguous(), ids[:, [1, 0, 2, 3]].contiguous()
'''


def test_a_kernel_routes_the_logits_only_side(tmp_path, logits_trace, make_trace):
    logits = logits_trace("logits.safetensors", torch.zeros(16))
    from routetool.io.trace import open_trace
    from routetool_kernels import reference

    with open_trace(logits) as t:  # the reference's ids and weights, recorded
        layers = {}
        for layer in t.layers:
            rows = t.read_rows(layer, 0, 40)
            w, ids, _, _ = reference.route(rows.gating_output, t.bias(layer), t.meta.router)
            layers[layer] = LayerArrays(topk_ids=ids, topk_weights=w, step_offsets=torch.tensor([0, 16, 40]))
        recorded = make_trace("recorded.safetensors", layers, router=t.meta.router)
    assert run(recorded, logits).exit_code == 0
    kfile = tmp_path / "k.py"
    kfile.write_text(KERNEL)
    js = tmp_path / "d.json"
    res = run(recorded, logits, "--kernel", f"{kfile}:swapped", "--json", js)
    assert res.exit_code == 1, res.output
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"]["order"] == 120 and doc["kernel"] == f"{kfile}:swapped"
    assert "logits routed by" in doc["b"]["holds"] and doc["a"]["holds"] == "trace: recorded ids"
    assert run(recorded, logits, "--kernel", f"{kfile}:swapped", "--ignore-order").exit_code == 0


def test_a_partial_trace_is_named_before_the_answer(tmp_path, make_trace):
    g = torch.randn(40, 16)
    router = RouterConfig(num_experts=16, topk=4, route_scale=2.5)
    t = make_trace("t.safetensors", {0: LayerArrays(gating_output=g, step_offsets=torch.tensor([0, 16, 40])),
                                                1: LayerArrays(gating_output=g[:16], step_offsets=torch.tensor([0, 16]))},
                   router=router)
    js = tmp_path / "d.json"
    res = run(t, t, "--json", js)
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert lines[0].startswith("INCOMPLETE TRACE: ") and lines[2] == "IDENTICAL (56 token-layers, 2 layers)"
    doc = json.loads(js.read_text())
    assert doc["complete"] is False and len(doc["partial"]) == 2
    assert doc["overall"]["tokens"] is None  # layers of other steps: no per-token measures


def test_a_kernel_routes_an_engine_output_of_logits_once_per_step(tmp_path, make_trace):
    # a FlashInfer-Trace folder: two workloads (steps of 5 and 7 tokens) of 16 experts, top-4
    from routetool_kernels import reference

    g = torch.Generator().manual_seed(5)
    logits = [torch.randn(5, 16, generator=g), torch.randn(7, 16, generator=g)]
    bias = (torch.randn(16, generator=g) * 0.05).to(torch.bfloat16)
    folder = tmp_path / "workloads"
    folder.mkdir()
    for i, lg in enumerate(logits):
        write_flashinfer_workload(folder, "moe_ds_routing_topk4_e16", lg, bias, seed=i)
    router = RouterConfig(num_experts=16, topk=4)
    w, ids, _, _ = reference.route(torch.cat(logits), bias.float(), router)
    recorded = make_trace(tmp_path / "recorded.safetensors",
                          {0: LayerArrays(topk_ids=ids, topk_weights=w, step_offsets=torch.tensor([0, 5, 12]))},
                          router=router)
    assert run(recorded, folder).exit_code == 0
    kfile = tmp_path / "k.py"
    kfile.write_text(KERNEL + STEP_SIZES)
    js = tmp_path / "d.json"
    res = run(recorded, folder, "--kernel", f"{kfile}:by_step", "--json", js)
    assert res.exit_code == 1, res.output
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"]["order"] == 12 and doc["b"]["holds"].endswith(f"logits routed by {kfile}:by_step")
    assert (tmp_path / "sizes.txt").read_text().split() == ["5", "7"]  # once per captured step, whole


STEP_SIZES = '''

def by_step(gating_output, bias, topk, route_scale, **kwargs):
    """The swapped reference, writing each call's rows beside itself."""
    from pathlib import Path

    with open(Path(__file__).parent / "sizes.txt", "a") as fh:
        fh.write(f"{gating_output.shape[0]}\\n")
    return swapped(gating_output, bias, topk, route_scale, **kwargs)
'''


def test_a_kernel_with_nothing_to_route_is_refused_in_one_line(tmp_path, make_trace):
    arr = routed_experts(tokens=6, layers=2, topk=2, experts=8, seed=3)
    npy = write_vllm_npy(tmp_path / "req.npy", arr)
    ids = torch.from_numpy(arr.astype("int64")).to(torch.int32)
    t = make_trace(tmp_path / "t.safetensors", {i: LayerArrays(topk_ids=ids[:, i].contiguous(),
                                                               step_offsets=torch.tensor([0, 6])) for i in range(2)},
                   router=RouterConfig(num_experts=8, topk=2, route_scale=1.0))
    res = CliRunner().invoke(main, ["diff", str(npy), str(t), "--kernel", "seed", "--no-progress"])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert ("--kernel seed routes logits, but neither source holds logits alone (A: vllm: recorded ids; B: trace: "
            "recorded ids)") in res.stderr


def test_a_kernel_beside_a_recorded_side_says_so(tmp_path, make_trace, logits_trace):
    logits = logits_trace(tmp_path / "logits.safetensors", torch.zeros(16))
    from routetool.io.trace import open_trace
    from routetool_kernels import reference

    with open_trace(logits) as t:
        layers = {}
        for layer in t.layers:
            w, ids, _, _ = reference.route(t.read_rows(layer, 0, 40).gating_output, t.bias(layer), t.meta.router)
            layers[layer] = LayerArrays(topk_ids=ids, topk_weights=w, step_offsets=torch.tensor([0, 16, 40]))
        recorded = make_trace(tmp_path / "recorded.safetensors", layers, router=t.meta.router)
    js = tmp_path / "d.json"
    # (the seed kernel's weights are a few ulps from the reference's: its own arithmetic)
    assert run(recorded, logits, "--kernel", "seed", "--json", js, "--weight-ulps", 8).exit_code == 0
    assert "--kernel seed routes logits alone; A (trace) records its routing, compared as recorded" in \
        json.loads(js.read_text())["notes"]


FLAKY = '''

CALLS = [0]


def every_other_pair(gating_output, bias, topk, route_scale, **kwargs):
    """The reference, its slots swapped on calls 3-4, 7-8, ...: a kernel that answers the same input two ways."""
    CALLS[0] += 1
    w, ids = swapped(gating_output, bias, topk, route_scale, **kwargs)
    if (CALLS[0] - 1) // 2 % 2:
        return w, ids
    return w[:, [1, 0, 2, 3]].contiguous(), ids[:, [1, 0, 2, 3]].contiguous()
'''


def test_a_kernel_is_called_on_each_side_even_for_the_same_logits(tmp_path, logits_trace):
    # a trace against itself is routed once by the reference (RouteMemo), but a kernel under test
    # is called for each side: two steps per layer, A's calls 1-2 as the reference, B's 3-4 swapped
    t = logits_trace(tmp_path / "t.safetensors", torch.zeros(16))
    kfile = tmp_path / "k.py"
    kfile.write_text(KERNEL + FLAKY)
    js = tmp_path / "d.json"
    assert run(t, t, "--kernel", f"{kfile}:every_other_pair", "--json", js).exit_code == 1
    assert json.loads(js.read_text())["overall"]["classes"]["order"] == 120


def test_sglang_routed_experts_take_the_other_sides_topk(tmp_path):
    # SGLang's routed experts do not record top-k: the other source's K, or --topk
    arr = routed_experts(tokens=6, layers=2, topk=2, experts=8, seed=4)
    gen = write_jsonl(tmp_path / "gen.jsonl", [sglang_generate(arr.astype("int32"), prompt_tokens=4, request_id="r1")])
    npy = tmp_path / "vllm"
    npy.mkdir()
    write_vllm_npy(npy / "r1.npy", arr)
    js = tmp_path / "d.json"
    res = run(npy, gen, "--json", js)
    assert res.exit_code == 0, res.output
    assert json.loads(js.read_text())["b"]["holds"] == "sglang-routed: recorded ids"
    assert run(gen, npy).exit_code == 0  # (either side)
    res = CliRunner().invoke(main, ["diff", str(gen), str(gen), "--no-progress"])
    assert res.exit_code == 2 and "pass the model's --topk" in res.stderr
    assert run(gen, gen, "--topk", 2).exit_code == 0


def test_kernel_b_routes_b_alone_the_reference_against_a_kernel_on_one_trace(tmp_path, logits_trace):
    t = logits_trace(tmp_path / "t.safetensors", torch.zeros(16))
    kfile = tmp_path / "k.py"
    kfile.write_text(KERNEL)
    js = tmp_path / "d.json"
    res = run(t, t, "--kernel-b", f"{kfile}:swapped", "--json", js)  # A by the reference, B by the kernel
    assert res.exit_code == 1, res.output
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"]["order"] == 120 and (doc["kernel"], doc["kernel_b"]) == (None, f"{kfile}:swapped")
    assert doc["a"]["holds"] == "trace: logits routed by the reference"
    assert doc["b"]["holds"] == f"trace: logits routed by {kfile}:swapped"
    # before and after: the same kernel on both sides is no change; the reference against it is
    assert run(t, t, "--kernel", f"{kfile}:swapped", "--kernel-b", f"{kfile}:swapped").exit_code == 0
    assert run(t, t, "--kernel", f"{kfile}:swapped", "--kernel-b", "reference", "--json", js, "--force").exit_code == 1
    assert json.loads(js.read_text())["kernel_b"] == "reference"
    arr = routed_experts(tokens=6, layers=2, topk=2, experts=8, seed=3)
    npy = write_vllm_npy(tmp_path / "req.npy", arr)
    res = CliRunner().invoke(main, ["diff", str(npy), str(npy), "--kernel-b", "seed", "--no-progress"])
    assert res.exit_code == 2 and "--kernel-b seed routes logits, but B does not hold logits alone" in res.stderr


def test_engine_against_trainer_with_layers_paired_by_order(tmp_path):
    # R3: vLLM numbers hidden layers (layer 0 dense, left out: MoE layers 1-3), Megatron's RouterReplay
    # its MoE layers (0-2); one request per file, named alike on both sides
    rollout, trainer = tmp_path / "rollout", tmp_path / "trainer"
    rollout.mkdir()
    trainer.mkdir()
    arrays = {f"req-{i}": routed_experts(tokens=4 + i, layers=4, topk=2, experts=8, dense=(0,), seed=i) for i in range(2)}
    for name, arr in arrays.items():
        write_vllm_npy(rollout / f"{name}.npy", arr)
        ids = torch.from_numpy(arr[:, 1:].astype("int64"))
        if name == "req-1":
            ids[3, 2] = ids[3, 2].flip(0)  # the trainer flips two slots of token 3, MoE layer 2 (hidden layer 3)
        write_megatron_replay(trainer / f"{name}.pt", ids, "list")
    res = CliRunner().invoke(main, ["diff", str(rollout), str(trainer), "--no-progress"])
    assert res.exit_code == 2 and "different layers (A holds 1,2,3, B holds 0,1,2)" in res.stderr
    js = tmp_path / "d.json"
    res = run(rollout, trainer, "--pair-layers", "--json", js)
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[0] == "DIFFERENT (1 of 27 token-layers; 0 outside near-ties)"
    doc = json.loads(js.read_text())
    assert doc["align"] == "requests" and [x["layer"] for x in doc["layers"]] == [1, 2, 3]
    assert [x["request"] for x in doc["first_differing_rows"]] == ["req-1"]
    assert doc["first_divergence"]["listed"] == [
        {"rank": None, "token": 7, "step": 1, "row": 3, "request": "req-1", "position": 3, "layer": 3}]
    assert "layers paired by order, A's-B's: 1-0, 2-1, 3-2 (numbered as A's)" in doc["notes"]
    assert run(rollout, trainer, "--pair-layers", "--layers", "1,2").exit_code == 0
    assert run(rollout, trainer, "--pair-layers", "--ignore-order").exit_code == 0  # the flip: the same experts


def test_a_kernel_routes_the_logits_beside_recorded_ids(hand, tmp_path):
    # A keeps its recorded ids; B's logits (the same file's) are routed by the reference: the same
    # experts in the same slots as recorded on the 5 unpadded rows of both layers (the reference's picks,
    # row 3's tie going to the lower expert 2), but the recorded weights 0.6/0.4 are not the
    # reference's renormalised sigmoids
    a, _ = hand
    js = tmp_path / "d.json"
    assert run(a, a, "--kernel-b", "reference", "--json", js).exit_code == 1
    doc = json.loads(js.read_text())
    assert doc["overall"]["classes"] == {"same": 0, "weights": 10, "order": 0, "tie": 0, "real": 0}
    assert (doc["a"]["holds"], doc["b"]["holds"]) == ("trace: recorded ids", "trace: logits routed by the reference")


def _recipes() -> list[str]:
    """The commands of docs/diff.md's recipes, as written there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "diff.md").read_text()
    section = text[text.index("## Recipes"):text.index("## Speed")]
    blocks = section.split("```")[1::2]
    return [line.strip() for b in blocks for line in b.strip().splitlines()]


ROUTE_FILE = '''
from routetool_kernels.reference import musespark1x_routing_reference


def route(gating_output, bias, topk, route_scale, router_output_multiplier=None, router_score_normalization="sigmoid",
          router_score_division_eps=None, topk_weights=None, topk_ids=None, *, is_padding=None):
    """The reference, as a kernel file."""
    return musespark1x_routing_reference(gating_output, bias, topk=topk, route_scale=route_scale,
                                         router_output_multiplier=router_output_multiplier,
                                         router_score_normalization=router_score_normalization,
                                         router_score_division_eps=router_score_division_eps, is_padding=is_padding)
'''


def test_the_recipes_in_the_docs_run_as_written(tmp_path, monkeypatch, make_trace, logits_trace):
    import shlex

    from routetool.io.trace import open_trace
    from routetool_kernels import reference

    monkeypatch.chdir(tmp_path)
    # R3: vLLM's routed experts (layer 0 dense) and Megatron's RouterReplay of the same requests
    for folder in ("rollout", "trainer"):
        (tmp_path / folder).mkdir()
    for i in range(2):
        arr = routed_experts(tokens=4 + i, layers=3, topk=2, experts=8, dense=(0,), seed=i)
        write_vllm_npy(tmp_path / "rollout" / f"req-{i}.npy", arr)
        write_megatron_replay(tmp_path / "trainer" / f"req-{i}.pt", torch.from_numpy(arr[:, 1:].astype("int64")), "list")
    # batch-invariant on/off: the same three requests, returned in another order
    arrays = [routed_experts(tokens=n, layers=2, topk=2, experts=8, seed=n) for n in (3, 5, 4)]
    _responses(tmp_path / "invariant-on.jsonl", [0, 1, 2], arrays)
    _responses(tmp_path / "invariant-off.jsonl", [2, 0, 1], arrays)
    # bf16 against fp32: the default synthetic trace
    for dtype in ("fp32", "bf16"):
        res = CliRunner().invoke(main, ["synth", "--dtype", dtype, "-o", f"router-{dtype}.safetensors", "--no-progress"])
        assert res.exit_code == 0, res.output
    # a capture: logits and what the engine's kernel (here the reference) recorded
    logits = logits_trace(tmp_path / "logits.safetensors", torch.zeros(16))
    with open_trace(logits) as t:
        layers = {}
        for layer in t.layers:
            g = t.read_rows(layer, 0, 40).gating_output
            w, ids, _, _ = reference.route(g, t.bias(layer), t.meta.router)
            layers[layer] = LayerArrays(gating_output=g, topk_ids=ids, topk_weights=w,
                                        step_offsets=torch.tensor([0, 16, 40]))
        make_trace(tmp_path / "capture.safetensors", layers, router=t.meta.router)
        for name in ("before", "after"):
            (tmp_path / name / "rank-0").mkdir(parents=True)
            make_trace(tmp_path / name / "rank-0" / "trace.safetensors", layers, router=t.meta.router)
    for name in ("old_kernel.py", "new_kernel.py"):
        (tmp_path / name).write_text(ROUTE_FILE)
    commands = _recipes()
    assert len(commands) == 6  # R3, batch-invariant, bf16/fp32, and three kernel comparisons
    for line in commands + ["routetool diff before/ after/ --align rows --details"]:
        argv = shlex.split(line)
        assert argv[:2] == ["routetool", "diff"]
        res = CliRunner().invoke(main, [*argv[1:], "--no-progress", *(["--force"] if "--json" in argv else [])],
                                 terminal_width=200)
        assert res.exit_code in (0, 1), (line, res.output)
        first = res.output.splitlines()[0]
        assert first.startswith(("IDENTICAL", "DIFFERENT")), (line, first)
        if "--kernel-b tiled" not in line:  # (the reference's own arithmetic everywhere else: no difference)
            assert res.exit_code == 0, (line, res.output)
    bf16 = CliRunner().invoke(main, ["diff", "router-fp32.safetensors", "router-bf16.safetensors", "--no-progress",
                                     "--weight-ulps", "65536", "--ignore-ties", "--ignore-order", "--max-flip-rate",
                                     "0.01"])
    assert bf16.output.splitlines()[0] == ("DIFFERENT (655 of 3,216 token-layers; 2 outside near-ties): within the "
                                           "thresholds (--ignore-ties, --ignore-order, --max-flip-rate 0.01: 2 counted)")


def test_the_measures_are_the_same_whether_few_or_most_rows_differ(tmp_path, make_trace):
    # the hand case's five rows (four differing: measured on every row at once) and the same five
    # among 20 more of the same routing (four of 25 differing: measured on those rows alone)
    extra = 20
    ids_a, w_a, logits = IDS_A[:5] + [[0, 1]] * extra, W_A[:5] + [[0.6, 0.4]] * extra, LOGITS[:5] + [[4, 3, 0, -1]] * extra
    ids_b, w_b = IDS_B[:5] + [[0, 1]] * extra, W_B[:5] + [[0.6, 0.4]] * extra
    docs = []
    for n, name in ((5, "few"), (5 + extra, "many")):
        a = make_trace(tmp_path / f"a-{name}.safetensors", {0: _layer(ids_a[:n], w_a[:n], logits[:n])}, router=ROUTER)
        b = make_trace(tmp_path / f"b-{name}.safetensors", {0: _layer(ids_b[:n], w_b[:n], logits[:n])}, router=ROUTER)
        js = tmp_path / f"{name}.json"
        assert run(a, b, "--json", js).exit_code == 1
        docs.append(json.loads(js.read_text()))
    few, many = docs
    assert few["overall"]["classes"] == {"same": 1, "weights": 1, "order": 1, "tie": 1, "real": 1}
    assert many["overall"]["classes"] == {"same": 1 + extra, "weights": 1, "order": 1, "tie": 1, "real": 1}
    assert few["margins"] == many["margins"] and few["first_differing_rows"] == many["first_differing_rows"]
    for key in ("weight_max_abs_delta", "weight_max_delta_ulps"):
        assert few["overall"][key] == many["overall"][key]
    assert many["overall"]["overlap_at_k"] == pytest.approx((7 + 2 * extra) / (2 * (5 + extra)))


def test_the_measures_do_not_depend_on_the_piece_size(tmp_path, monkeypatch, logits_trace, make_trace):
    # pieces of 5 rows cut the steps (16 and 24 rows) and the examples' search: every number, the
    # margins and the first differing rows must be those of one piece per layer
    import routetool.analysis.diff as diff_module

    a = logits_trace("a.safetensors", torch.zeros(16))
    b = logits_trace("b.safetensors", torch.linspace(-0.3, 0.3, 16), seed=0)
    docs = {}
    for rows in (5, 1 << 12):
        monkeypatch.setattr(diff_module, "CPU_PIECE_BYTES", 4 * 16 * rows)
        js = tmp_path / f"{rows}.json"
        assert run(a, b, "--json", js).exit_code == 1
        docs[rows] = json.loads(js.read_text())
    assert docs[5] == docs[1 << 12]
    assert docs[5]["overall"]["classes"]["real"] > 0 and docs[5]["first_differing_rows"]


def test_the_command_offers_every_alignment():
    from routetool.analysis.diff import ALIGNS
    from routetool.cli.diff import diff

    (align,) = [p for p in diff.params if p.name == "align"]
    assert tuple(align.type.choices) == ALIGNS and align.default == "auto"


def test_a_layer_with_real_disagreements_is_never_left_off_the_summary(make_trace):
    # layers 0, 1 and 3: every row's slots flipped (harmless, a large share); layer 2: one row routed to
    # other experts. The summary ranks layer 2 first and, without logits, says ties were not judged.
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]] * 2, dtype=torch.int32)
    flipped = ids.flip(-1).contiguous()
    other = ids.clone()
    other[5] = torch.tensor([0, 7], dtype=torch.int32)
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
    a = make_trace("a.safetensors", {i: LayerArrays(topk_ids=ids) for i in range(4)}, router=router)
    b = make_trace("b.safetensors", {0: LayerArrays(topk_ids=flipped), 1: LayerArrays(topk_ids=flipped),
                                     2: LayerArrays(topk_ids=other), 3: LayerArrays(topk_ids=flipped)}, router=router)
    res = run(a, b)
    assert res.exit_code == 1, res.output
    first = res.output.splitlines()[0]
    assert first == "DIFFERENT (25 of 32 token-layers; 1 with other experts, not judged for near-ties)", first
    table = res.output[res.output.index("Worst layers"):]
    assert "real disagreements" in table
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows][:1] == ["2"] and len(rows) == 3, table
    same = run(a, a)
    assert same.output.startswith("IDENTICAL (32 token-layers, 4 layers)"), same.output
    one = make_trace("one.safetensors", {0: LayerArrays(topk_ids=ids)}, router=router)
    assert run(one, one).output.startswith("IDENTICAL (8 token-layers, 1 layer)")
    bad = run(a, b, "--max-flip-rate", "2")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_expert_ids_out_of_range_are_one_line(tmp_path, make_trace):
    # a recording holding an id past E: refused naming the file and the row (exit 2); a kernel returning
    # one: a failing kernel (exit 1); never a traceback, never IDENTICAL
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    ids = g.topk(2, dim=-1).indices.to(torch.int32)
    bad = ids.clone()
    bad[2, 0] = 99
    good = make_trace("good.safetensors", {0: LayerArrays(gating_output=g, topk_ids=ids)}, router=router)
    oor = make_trace("oor.safetensors", {0: LayerArrays(gating_output=g, topk_ids=bad)}, router=router)
    for args in ((good, oor), (oor, oor)):
        res = run(*args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert f"{oor}: holds expert id 99 outside [0, 8) on layer 0, row 2" in res.output, res.output
    kernel = tmp_path / "k.py"
    kernel.write_text(
        "import torch\n"
        "def bad(gating_output, bias, topk, route_scale, router_output_multiplier=None,\n"
        "        router_score_normalization='sigmoid', router_score_division_eps=None, topk_weights=None,\n"
        "        topk_ids=None, *, is_padding=None):\n"
        "    n = gating_output.shape[0]\n"
        "    return torch.full((n, topk), 0.5, device=gating_output.device), \\\n"
        "        torch.full((n, topk), 99, dtype=torch.int32, device=gating_output.device)\n")
    res = run(good, good, "--kernel-b", f"{kernel}:bad", "--device", "cpu")
    assert res.exit_code == 1 and "returned expert id 99 outside [0, 8)" in res.output, res.output
    assert "Traceback" not in res.output


def test_output_folders_are_never_named_twice_or_inside_an_input(tmp_path, make_trace):
    router = RouterConfig(num_experts=8, topk=2, route_scale=1.0)
    g = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    run_dir = tmp_path / "run"
    (run_dir / "rank-0").mkdir(parents=True)
    make_trace(run_dir / "rank-0" / "t.safetensors", {0: LayerArrays(gating_output=g)}, router=router, rank="0")
    for args, words in ((["--plot", run_dir / "rank-7"], "inside this run's input folder"),
                        (["--plot", tmp_path / "p", "--json", tmp_path / "p"], "is named for two outputs")):
        res = CliRunner().invoke(main, ["balance", str(run_dir), "--no-progress", *map(str, args)])
        assert res.exit_code == 2 and words in res.output, res.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-0"] and not (tmp_path / "p").exists()
    res = CliRunner().invoke(main, ["replay", str(run_dir), "--device", "cpu", "--no-progress", "--save-routing",
                                    str(run_dir / "rank-9")])
    assert res.exit_code == 2 and "inside this run's input folder" in res.output, res.output
    assert sorted(p.name for p in run_dir.iterdir()) == ["rank-0"]
