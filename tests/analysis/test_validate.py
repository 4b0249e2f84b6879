"""`routetool validate`: the suite, the verdicts, mutation tests, JSON/JUnit, CLI."""

import json
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mutants
import semantic_kernels
from conftest import DEVICE, HAS_CUDA
from routetool.cli import main
from routetool.engine.execution import select_execution
from routetool.analysis.suite import BATCH_SIZES, FAMILIES, GPU_BATCH_SIZES, build_suite
from routetool.io.trace import LayerArrays
from routetool.analysis.validate import rejection_documented, validate

ROOT = Path(__file__).resolve().parents[2]
QUICK = build_suite("quick")
SEED_QUICK = [c for c in QUICK if "beyond_seed" not in c.tags]
"""The cases of the seed's semantics: those the mutants (seed signature, seed semantics) route."""


@pytest.fixture(scope="module")
def execution():
    return select_execution("cuda" if HAS_CUDA else "cpu")


def _classes(result):
    return {c for case in result.cases for c in case.failure_classes}


def test_suite_covers_every_family_with_fixed_seeds():
    assert {c.family for c in QUICK} == set(FAMILIES)
    full = build_suite("full")
    shapes = {c.name for c in full if c.family == "shapes"}
    for E in (1, 2, 3, 8, 24, 60, 64, 72, 128, 160, 256, 384, 512):
        assert f"shapes/T33-E{E}-k{min(E, 8)}" in shapes or f"shapes/T33-E{E}-k{E}" in shapes
    # same inputs on every build
    a = QUICK[0].build(DEVICE).gating_output
    b = build_suite("quick")[0].build(DEVICE).gating_output
    assert a.equal(b)


def test_reference_passes_everything(execution):
    result = validate(mutants.correct, "reference", execution, cases=QUICK)
    assert result.ok, [(c.name, c.failure_classes, c.message) for c in result.cases if not c.ok]
    assert all(c.verdict in ("pass", "pass_tie", "skipped") for c in result.cases)


def test_other_tie_break_is_tie_equivalent_not_failed(execution):
    result = validate(mutants.highest_index_ties, "highest-index-ties", execution, cases=SEED_QUICK)
    assert result.ok, _classes(result)
    tie_cases = [c for c in result.cases if c.verdict == "pass_tie"]
    assert tie_cases and all(c.family in ("ties", "nonfinite", "bias") for c in tie_cases)
    assert sum(c.tie_rows for c in tie_cases) > 20


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_each_mutant_fails_with_its_class(name, execution):
    fn, expected = mutants.MUTANTS[name]
    result = validate(fn, name, execution, cases=QUICK)
    assert not result.ok
    assert expected in _classes(result), (expected, _classes(result))
    failed = [c for c in result.cases if c.verdict == "fail" and expected in c.failure_classes]
    case = failed[0]
    if expected.startswith(("invalid", "mismatch", "weight")):
        row = case.rows[0]
        assert row.expected_ids != row.got_ids or row.expected_weights != row.got_weights
        assert row.top_inputs, "the offending row's inputs are reported"


# (num_experts, topk) of served models -> a model named by the quick suite's case of that shape
PRODUCTION = {(8, 2): "Mixtral", (60, 4): "Qwen1.5-MoE", (64, 8): "Qwen2-57B", (64, 6): "DeepSeek-V2-Lite",
              (160, 6): "DeepSeek-V2", (128, 8): "Qwen3-30B", (256, 8): "DeepSeek-V3", (160, 8): "GLM-4.5",
              (384, 8): "Kimi-K2", (512, 10): "Qwen3-Next", (128, 4): "gpt-oss-120b"}
MODELS = [c for c in QUICK if c.family == "models"]
SEED_MODELS = [c for c in MODELS if "beyond_seed" not in c.tags]


def test_quick_holds_every_production_shape_and_names_its_model():
    # a kernel wrong at one production (E, topk) only, or for topk > 8 only, passed quick: its shapes
    # family holds E in (1, 3, 8, 60, 256, 384) x topk (1, 8)
    for (E, K), model in PRODUCTION.items():
        assert [c for c in MODELS if f"/E{E}-k{K}" in c.name and model in c.description], (E, K, model)
    text = " ".join(c.description for c in MODELS)
    assert all(m in text for m in ("OLMoE", "GLM-4.5-Air", "DeepSeek-R1", "MuseSpark1x", "Qwen3-235B"))
    cpu = [c for c in MODELS if not c.cuda_only]
    inputs = [c.build(torch.device("cpu")) for c in cpu]
    assert {i.topk for i in inputs} >= {2, 4, 6, 8, 10, 16, 22}
    assert {i.router.router_score_normalization for i in inputs} == {"sigmoid", "softmax", "sqrtsoftplus",
                                                                     "topk_then_softmax"}
    assert any(bool(i.bias.any()) for i in inputs) and any(not i.bias.any() for i in inputs)
    assert {i.gating_output.dtype for i in inputs} == {torch.float32, torch.bfloat16}
    assert all(i.is_padding.any() and not i.is_padding.all() for i in inputs)  # padded rows among real ones
    assert all(i.gating_output.shape[0] == 7 for i in inputs)  # a few tokens: the interpreter is slow
    # each judged for determinism and batch invariance; a GPU-only twin routes its tokens in large batches,
    # the largest twice
    twins = [c for c in MODELS if c.cuda_only]
    assert {c.checks for c in cpu} == {("determinism", "batch")}
    assert {c.checks for c in twins} == {("batch", "batch_determinism")}
    assert [c.batch_sizes for c in cpu] == [BATCH_SIZES] * len(cpu)
    assert [c.name for c in twins] == [c.name + "/large-batches" for c in cpu]
    assert {c.batch_sizes for c in twins} == {GPU_BATCH_SIZES}
    assert [c.name for c in build_suite("full", ["models"])] == [c.name for c in MODELS]


def test_batch_sizes_cross_the_tiled_kernels_switches():
    # the sizes are chosen from kernel/routing_policy.py's launch settings: when they change, the sizes must follow
    from routetool_kernels import routing_policy

    for case in (c for c in MODELS if not c.cuda_only):
        inp = case.build(torch.device("cpu"))
        E, K = inp.gating_output.shape[1], inp.topk
        # under the interpreter: a 1-row tile, one 8-row tile (a row masked), two 128-row tiles
        sizes = (inp.gating_output.shape[0], *case.batch_sizes)
        tiles = {(cfg.block_t, -(-n // cfg.block_t))
                 for n in sizes for cfg in [routing_policy.default_config(n, E, inp.gating_output.dtype, "cpu", K)]}
        assert tiles == {(1, 1), (8, 1), (128, 2)}, (case.name, tiles)
        # on a GPU: scan up to SMALL_BATCH, two-level above it, a persistent grid beyond 32 programs per SM on
        # up to 256 SMs, tiles claimed from counters from DYNAMIC_TILES_FROM grids' worth on up to 148 SMs
        configs = [routing_policy.default_config(n, E, inp.gating_output.dtype, "cuda", K,
                                                 inp.router.router_score_normalization)
                   for n in GPU_BATCH_SIZES]
        assert {routing_policy.SMALL_BATCH, routing_policy.SMALL_BATCH + 1} <= set(GPU_BATCH_SIZES)
        if configs[1].algorithm == "rows":  # (sigmoid, topk <= 8, <= 256 experts: rows above SMALL_BATCH)
            assert [c.algorithm for c in configs] == ["scan"] + ["rows"] * (len(configs) - 1)
            table = routing_policy.rows_launches(E, inp.gating_output.dtype)
            assert {c.chunk for c in configs[1:]} == {lanes for _, lanes, _ in table}  # each of its launches
            continue
        assert [c.algorithm for c in configs] == ["scan"] + ["two_level"] * 5
        assert not configs[1].programs_per_sm and configs[2].programs_per_sm
        assert GPU_BATCH_SIZES[2] == routing_policy.PERSISTENT_FROM + 1
        assert GPU_BATCH_SIZES[3] > configs[3].programs_per_sm * 256
        assert configs[4].dynamic_tiles
        assert GPU_BATCH_SIZES[4] >= routing_policy.DYNAMIC_TILES_FROM * configs[4].programs_per_sm * 148


@pytest.mark.parametrize("name", ["wrong_at_160_experts_k8", "eight_slots", "large_batch_rounding"])
def test_shape_and_batch_bugs_are_found_by_the_models_family(name, execution):
    # each passed the quick suite before it held the models family
    fn, expected = mutants.MUTANTS[name]
    assert validate(fn, name, execution, cases=[c for c in QUICK if c.family != "models"]).ok
    found = validate(fn, name, execution, cases=SEED_MODELS)
    assert _classes(found) == {expected}, _classes(found)


# -- the semantics of production models (docs/semantics.md) -----------------------------------------
BEYOND = [c for c in MODELS if "beyond_seed" in c.tags and not c.cuda_only]


def test_the_models_family_holds_each_semantics_beyond_the_seed():
    assert {c.tags["beyond_seed"][0] for c in BEYOND} == {"n_group", "sqrtsoftplus", "norm_topk_prob",
                                                           "topk_then_softmax"}
    grouped = next(c for c in BEYOND if c.name == "models/deepseek-v3-grouped/E256-k8").build(torch.device("cpu"))
    assert (grouped.router.n_group, grouped.router.topk_group, grouped.router.num_experts) == (8, 4, 256)
    # its groups change the picks of some token: a kernel that ignores them cannot pass by chance
    from routetool_kernels import reference

    plain = reference.route(grouped.gating_output, grouped.bias, replace(grouped.router, n_group=None, topk_group=None))
    assert (plain[1] != grouped.reference()[1]).any(-1).sum() >= 3


def test_a_bf16_bias_changes_the_picks_of_the_models_case_that_holds_it():
    from routetool_kernels import reference

    case = next(c for c in MODELS if c.name == "models/deepseek-v3-bf16-bias/E256-k8")
    inp = case.build(torch.device("cpu"))
    assert inp.bias.dtype == torch.bfloat16 and case.feature == "bias bfloat16"
    from routetool.analysis.suite import _gen

    fp32 = 1.5 + torch.randn(256, generator=_gen(case.name + "/bias")) * 0.05  # the values before rounding
    assert torch.equal(fp32.to(torch.bfloat16), inp.bias)
    picks_bf16 = inp.reference()[1]
    picks_fp32 = reference.route(inp.gating_output, fp32, inp.router, is_padding=inp.is_padding)[1]
    assert (picks_bf16 != picks_fp32).any(-1).sum() >= 2  # the bias's dtype reorders the top-k


@pytest.mark.parametrize("fn", [semantic_kernels.engine_router, mutants.correct])
def test_a_kernel_written_to_each_semantics_passes_the_models_family(fn, execution):
    result = validate(fn, fn.__name__, execution, cases=[c for c in MODELS if not c.cuda_only])
    assert result.ok and {c.verdict for c in result.cases} == {"pass"}, \
        [(c.name, c.failure_classes, c.message) for c in result.cases if c.verdict != "pass"]


@pytest.mark.parametrize("bug", sorted(semantic_kernels.BUGS))
def test_the_classic_bug_of_each_semantics_fails_its_case(bug, execution):
    fn, case_name, cls = semantic_kernels.BUGS[bug]
    result = validate(fn, bug, execution, cases=[c for c in MODELS if c.name == case_name])
    case = result.cases[0]
    assert case.verdict == "fail" and cls in case.failure_classes, (case.failure_classes, case.message)
    assert case.rows and case.rows[0].expected_ids != case.rows[0].got_ids or \
        case.rows[0].expected_weights != case.rows[0].got_weights
    assert result.exit_code == 1


def test_the_musespark1x_kernels_reject_what_they_do_not_implement_and_validate_says_which(execution):
    import routetool_kernels

    for variant in routetool_kernels.VARIANT_NAMES:
        result = validate(routetool_kernels.variant(variant), variant, execution, cases=BEYOND)
        assert result.ok and {c.verdict for c in result.cases} == {"rejected"}, [(c.name, c.message) for c in
                                                                               result.cases]
        for case, c in zip(BEYOND, result.cases):  # the semantics named, then the kernel's own words
            assert c.message.startswith(f"documented rejection of {case.tags['beyond_seed'][0]}: "), c.message
            assert case.tags["beyond_seed"][0] in c.message.split(": ", 1)[1], c.message
    # a kernel of the seed's signature that does not say so fails, told which semantics and how to document it
    tiled = routetool_kernels.variant("tiled")

    def undocumented(*args, **kwargs):
        """Plain top-k routing."""
        return tiled(*args, **kwargs)

    result = validate(undocumented, "undocumented", execution, cases=BEYOND)
    assert {c.verdict for c in result.cases} == {"fail"} and _classes(result) == {"rejected_undocumented"}
    grouped = next(c for c in result.cases if c.name == "models/deepseek-v3-grouped/E256-k8")
    assert grouped.message.startswith("undocumented rejection of n_group: TypeError: ")
    assert "name n_group in its docstring as unsupported" in grouped.message


@pytest.mark.parametrize("name", ["racy_ties", "atomic_order_sum"])
def test_a_nondeterministic_kernel_is_reported_as_such_with_the_rows_that_changed(name, execution):
    # a kernel whose output changed from call to call was reported as row_order_dependence
    fn, _ = mutants.MUTANTS[name]
    result = validate(fn, name, execution, cases=SEED_QUICK)
    assert _classes(result) == {"nondeterministic"}, _classes(result)
    case = next(c for c in result.cases if c.verdict == "fail")
    row = case.rows[0]
    assert row.failure_class == "nondeterministic" and row.batch_sizes is None
    assert (row.expected_ids, row.expected_weights) != (row.got_ids, row.got_weights)
    if name == "atomic_order_sum":  # the same experts, weights apart by float32 rounding only
        assert row.expected_ids == row.got_ids
        assert max(abs(a - b) for a, b in zip(row.expected_weights, row.got_weights)) < 1e-6
        model = next(c for c in result.cases if c.name == "models/deepseek-v3-r1/E256-k8")
        assert model.failure_classes == ["nondeterministic"] and model.rows[0].batch_sizes is None
        # the GPU twins route their largest batch twice: there the row is one of that batch
        twin = next(c for c in MODELS if c.name == "models/deepseek-v3-r1/E256-k8/large-batches")
        twin = replace(twin, cuda_only=False, batch_sizes=(129,))
        row = validate(fn, name, execution, cases=[twin]).cases[0].rows[0]
        assert (row.failure_class, row.batch_sizes, row.positions) == ("nondeterministic", [129, 129], [row.row] * 2)


def _reversed_sum_where(rows_reversed):
    """A kernel summing the picked scores last slot first on the rows ``rows_reversed(gating_output,
    is_padding)`` selects: their weights differ from the reference's in the last bits."""
    def fn(gating_output, bias, topk, route_scale, *a, topk_weights=None, topk_ids=None, is_padding=None, **k):
        w, ids = mutants._weights_summed(gating_output, bias, topk, route_scale, *a, is_padding=is_padding, **k)
        w_rev, _ = mutants._weights_summed(gating_output, bias, topk, route_scale, *a, is_padding=is_padding,
                                           reverse=True, **k)
        w = torch.where(rows_reversed(gating_output, is_padding).to(w.device)[:, None], w_rev, w)
        return mutants._out(w, ids, topk_weights, topk_ids)
    return fn


@pytest.mark.parametrize("rows_reversed, sizes, position", [
    # the batch's size (a prefill path above 128 tokens)
    (lambda g, pad: torch.full((g.shape[0],), g.shape[0] > 128), [7, 129], None),
    # the token's position (a second tile from row 128 on)
    (lambda g, pad: torch.arange(g.shape[0]) >= 128, [7, 129], 128),
    # the padding around it (a path taken without a padding mask)
    (lambda g, pad: torch.full((g.shape[0],), pad is None), [7, 1], 0),
])
def test_batch_variance_reports_the_token_both_batch_sizes_and_both_outputs(rows_reversed, sizes, position,
                                                                             execution):
    case = next(c for c in MODELS if c.name == "models/deepseek-v3-r1/E256-k8")
    fn = _reversed_sum_where(rows_reversed)
    res = validate(fn, "variant", execution, cases=[case]).cases[0]
    assert res.failure_classes == ["batch_variant"], res
    row = next(r for r in res.rows if r.batch_sizes == sizes)
    assert row.failure_class == "batch_variant" and row.positions[0] == row.row and not row.is_padding
    if position is not None:
        assert row.positions[1] == position
    inp = case.build(DEVICE)
    w, ids = fn(inp.gating_output, inp.bias, **inp.kwargs())  # the token in the case's own batch
    assert row.expected_ids == row.got_ids == ids[row.row].tolist()
    assert row.expected_weights == [float(x) for x in w[row.row]] != row.got_weights


def test_a_failing_case_shows_its_class_first_row_and_both_outputs_on_one_screen(tmp_path):
    # the terminal showed ids only (`row 1: [39, 1, ...] -> [39, 1, ...]`), in a table that split at 80 columns
    from routetool.report.tables import Console
    from routetool.report.validate import render_validate

    execution = select_execution("cpu")
    cases = [c for c in SEED_QUICK if c.family in ("models", "nonfinite")]
    for name, must in (("large_batch_rounding", ["✗ models/qwen1.5-moe/E60-k4  batch_variant",
                                                 "token 4: in a batch of 7 (row 4) and of 129 (row 56)",
                                                 "B=7   ids 29 24 22 56; w 0.460 0.273 0.151 0.116",
                                                 "B=129 ids the same; w of slot 0 (expert 29) 0.460315973, not "
                                                 "0.460316002"]),
                       ("wrong_at_160_experts_k8", ["✗ models/glm-4.5/E160-k8  mismatch", "row 3: mismatch",
                                                    "expected ids 98 73 121 157 103 12 30 141; w 0.300 0.311 ",
                                                    "got      ids 98 73 121 103 12 30 71 44; w 0.303 0.314 "]),
                       ("nan_unsafe", ["Failing cases (7; 5 shown): invalid:nonfinite_weight 7",
                                       "got      ids 0 1 2 3 4 5; w nan nan", "and 2 more failing cases"])):
        result = validate(getattr(mutants, name), name, execution, cases=cases)
        console = Console(width=80, record=True, color_system=None)
        render_validate(result, console)
        text = console.export_text()
        assert len(text.splitlines()) <= 50, text
        assert all(m in text for m in must), text
        doc = json.loads(json.dumps(__import__("routetool.report.validate", fromlist=["x"]).validate_json(result)))
        rows = [r for c in doc["cases"] for r in c["rows"]]
        assert all(("batch_sizes" in r) == (r["failure_class"] == "batch_variant") for r in rows)


def test_project_kernel_passes_quick_suite(execution):
    import routetool_kernels

    result = validate(routetool_kernels.variant("tiled"), "tiled", execution, cases=QUICK)
    assert result.ok, [(c.name, c.failure_classes, c.message) for c in result.cases if not c.ok]


def test_seed_variant_passes_on_fp32_and_fails_nonfinite(execution):
    import routetool_kernels

    seed = routetool_kernels.variant("seed")
    # one models case: the seed takes a program per token, 4-10 s per 129-token batch under the interpreter
    finite = [c for c in QUICK if c.family not in ("nonfinite", "models")] + MODELS[:1]
    result = validate(seed, "seed", execution, cases=finite)
    assert result.ok, [(c.name, c.failure_classes) for c in result.cases if not c.ok]
    rejected = [c for c in result.cases if c.verdict == "rejected"]
    assert rejected and all(("bfloat16" in c.message or "float16" in c.message) for c in rejected)
    nonfinite = validate(seed, "seed", execution, cases=[c for c in QUICK if c.family == "nonfinite"])
    assert "invalid:nonfinite_weight" in _classes(nonfinite)


def test_a_family_named_twice_runs_once(tmp_path):
    # --family ties --family ties ran every ties case twice (duplicate JUnit testcase names)
    once = [c.name for c in build_suite("quick", ["ties"])]
    assert [c.name for c in build_suite("quick", ["ties", "ties"])] == once
    assert [c.name for c in build_suite("quick", ["dtypes", "ties", "dtypes"])] == (
        [c.name for c in build_suite("quick", ["dtypes"])] + once)  # first-seen order
    res = CliRunner().invoke(main, ["validate", "--family", "dtypes", "--family", "dtypes", "--kernel",
                                    f"{ROOT / 'tests' / 'mutants.py'}:correct", "--device",
                                    "cuda" if HAS_CUDA else "cpu", "--no-progress", "--junit", "-"])
    names = [tc.get("name") for tc in ET.fromstring(res.stdout.split("\n", 1)[1]).iter("testcase")]
    assert res.exit_code == 0 and names == [c.name for c in build_suite("quick", ["dtypes"])], res.output


def test_rejection_is_documented_only_when_the_docstring_says_so():
    import routetool_kernels

    assert rejection_documented(routetool_kernels.variant("seed"), "bfloat16")
    assert not rejection_documented(mutants.rejects_bf16, "bfloat16")
    assert not rejection_documented(routetool_kernels.variant("seed"), None)


@pytest.mark.parametrize("fn, cls, words", [
    # outputs on another device (meta: no data) crashed the comparison, a rejected_undocumented verdict
    (lambda *a, **k: tuple(t.to("meta") for t in mutants.correct(*a, **k)), "wrong_device",
     "the kernel returned topk_weights and topk_ids on device meta; its inputs are on device"),
    (lambda *a, **k: (mutants.correct(*a, **k)[0], mutants.correct(*a, **k)[1].to("meta")), "wrong_device",
     "the kernel returned topk_ids on device meta"),
    # no pair of tensors was a failed unpacking, reported as a rejection (TypeError, ValueError)
    (lambda *a, **k: None, "wrong_shape", "the kernel returned (NoneType); expected (topk_weights float32 ["),
    (lambda *a, **k: (*mutants.correct(*a, **k), 1), "wrong_shape", "int32, int); expected (topk_weights"),
])
def test_outputs_that_are_not_two_tensors_on_the_inputs_device_fail(execution, fn, cls, words):
    ties = [c for c in QUICK if c.family == "ties" and not (c.cuda_only and not HAS_CUDA)]
    result = validate(fn, "odd", execution, cases=ties)
    assert {c.verdict for c in result.cases} == {"fail"}
    assert {tuple(c.failure_classes) for c in result.cases} == {(cls,)}
    assert all(words in c.message for c in result.cases), result.cases[0].message


def test_evaluate_refuses_outputs_on_another_device():
    # bench judges outputs with evaluate(): meta outputs raised NotImplementedError, a "rejected" row
    from routetool.analysis.validate import evaluate

    inp = QUICK[0].build(DEVICE)
    w, ids = mutants.correct(inp.gating_output, inp.bias, **inp.kwargs())
    assert evaluate(inp, w, ids, tie_ulps=16)[0] == []
    assert evaluate(inp, w.to("meta"), ids, tie_ulps=16)[0] == ["wrong_device"]


def test_traces_are_validated_layer_by_layer(execution):
    import routetool_kernels

    trace = ROOT / "traces" / "deepseek-v3-hf-tiny.safetensors"
    result = validate(routetool_kernels.variant("tiled"), "tiled", execution, cases=[], traces=[trace])
    assert [c.name.rsplit("/", 1)[1] for c in result.cases] == ["layer1", "layer2", "layer3"]
    assert result.ok
    bad = validate(mutants.biased_weights, "biased", execution, cases=[], traces=[trace])
    assert not bad.ok and "weight_error" in _classes(bad)
    bf16 = ROOT / "traces" / "musespark1x-synth-bf16.safetensors"
    rej = validate(routetool_kernels.variant("seed"), "seed", execution, cases=[], traces=[bf16])
    assert len(rej.cases) == 4 and not rej.ok  # one case per layer, each failed: see the test below
    assert {(c.verdict, tuple(c.failure_classes)) for c in rej.cases} == {("fail", ("rejected_documented",))}


def test_trace_cases_check_the_weights_of_tie_rows_and_report_rows_as_suite_cases_do(execution, make_trace):
    # a trace was judged by replay's summary alone: weights of tie-equivalent rows went unchecked (a
    # kernel breaking ties toward the highest expert with wrong weights on those rows passed), and
    # its offending rows had is_padding False, no top_inputs and a row class as failure class
    from routetool_kernels.reference import musespark1x_routing_reference as ref

    g = torch.zeros(12, 8)
    g[:, 0] = 3.0
    g[:, 5] = g[:, 6] = 1.0  # experts 5 and 6 tie for the second place
    pad = torch.zeros(12, dtype=torch.bool)
    pad[10:] = True
    path = make_trace("ties.safetensors", {0: LayerArrays(gating_output=g, is_padding=pad,
                                                          step_offsets=torch.tensor([0, 6, 12]))})

    def tie_high_bad_weights(gating_output, bias, topk, route_scale, *args, is_padding=None, **kwargs):
        w, ids = ref(gating_output, bias, topk, route_scale, is_padding=is_padding)
        tied = (ids == 5).any(-1)
        ids = torch.where(ids == 5, 6, ids)  # the other expert of the tie: still tie-equivalent
        return torch.where(tied[:, None] & (ids >= 0), w * 1.5, w), ids

    def pad_ids_only(gating_output, bias, topk, route_scale, *args, is_padding=None, **kwargs):
        w, ids = ref(gating_output, bias, topk, route_scale)
        return w, torch.where(is_padding[:, None], -1, ids)  # weights of padded rows left

    bad = validate(tie_high_bad_weights, "tie_high", execution, cases=[], traces=[path]).cases[0]
    assert bad.verdict == "fail" and "weights_not_renormalized_unbiased" in bad.failure_classes, bad
    padded = validate(pad_ids_only, "pad_ids_only", execution, cases=[], traces=[path]).cases[0]
    assert padded.failure_classes == ["invalid:bad_padding"], padded
    row = padded.rows[0]
    assert (row.row, row.failure_class, row.is_padding) == (10, "invalid:bad_padding", True)
    assert [x["expert"] for x in row.top_inputs][:1] == [0]


def _rejecting_kernels(tmp_path):
    src = tmp_path / "rejecting.py"
    src.write_text(
        "def claims_all_dtypes(gating_output, bias, topk, route_scale, *a, **k):\n"
        "    \"\"\"Top-k routing for float32, bfloat16 and float16 router logits.\"\"\"\n"
        "    raise ValueError('not implemented yet')\n"
        "def nodoc(gating_output, bias, topk, route_scale, *a, **k):\n"
        "    raise NotImplementedError('later')\n"
        "def must_not_be_called(gating_output, bias, topk, route_scale, *a, **k):\n"
        "    raise RuntimeError('called')\n"
    )
    return src


@pytest.fixture
def two_dtype_traces(make_trace):
    """The same 12 rows of logits, as float32 (``t_fp32.safetensors``) and bfloat16 (``t_bf16``)."""
    g = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    return (make_trace("t_fp32.safetensors", {0: LayerArrays(gating_output=g)}),
            make_trace("t_bf16.safetensors", {0: LayerArrays(gating_output=g.bfloat16())}))


def test_a_kernel_that_rejects_a_trace_fails_documented_or_not(execution, tmp_path, two_dtype_traces):
    # a trace case whose kernel rejected every step passed ("rejected"), and the run said PASS,
    # whenever the trace's dtype name stood anywhere in the docstring: "float32" in one that
    # claims to support it, and the seed's documented bf16 restriction. A trace is production
    # input: a kernel that cannot route it fails
    import routetool_kernels

    fp32, bf16 = two_dtype_traces
    rej = validate(routetool_kernels.variant("seed"), "seed", execution, cases=[], traces=[bf16])
    assert not rej.ok and [(c.verdict, c.failure_classes) for c in rej.cases] == [("fail", ["rejected_documented"])]
    assert "kernel 'seed' rejected layer 0 step 0 (ValueError: gating_output dtype bfloat16" in rej.cases[0].message
    src = _rejecting_kernels(tmp_path)
    for fn, classes in (("claims_all_dtypes", ["rejected_undocumented", "rejected_documented"]),
                        ("nodoc", ["rejected_undocumented", "rejected_undocumented"])):
        res = CliRunner().invoke(main, ["validate", str(fp32), str(bf16), "--suite", "none", "--kernel", f"{src}:{fn}",
                                        "--device", DEVICE.type, "--no-progress", "--json", "-"])
        assert res.exit_code == 1, res.output
        doc = json.loads(res.stdout)
        assert doc["verdict"] == "fail" and [c["verdict"] for c in doc["cases"]] == ["fail", "fail"]
        assert [c["failure_classes"] for c in doc["cases"]] == [[cls] for cls in classes], doc["cases"]
        assert "FAIL: 2 of 2 cases failed" in res.stderr and "PASS" not in res.stderr
    # the suite's rule is unchanged: its bf16 case's documented rejection passes (the input is synthetic)
    bf16_cases = [c for c in QUICK if c.name.startswith("dtypes/bfloat16")]
    suite = validate(routetool_kernels.variant("seed"), "seed", execution, cases=bf16_cases)
    assert suite.ok and {c.verdict for c in suite.cases} == {"rejected"}


def test_a_run_that_routed_nothing_says_nothing_validated(execution, tmp_path):
    # documented rejections and skips alone ended in "PASS: n cases, nothing failed"
    import routetool_kernels

    from routetool.report.tables import Console
    from routetool.report.validate import render_validate

    bf16_cases = [c for c in QUICK if c.name.startswith("dtypes/bfloat16")]
    result = validate(routetool_kernels.variant("seed"), "seed", execution, cases=bf16_cases)
    console = Console(width=100, record=True, color_system=None)
    render_validate(result, console)
    text = console.export_text()
    assert result.ok and "NOTHING CHECKED: all 2 cases were skipped or rejected" in text and "PASS" not in text


def test_the_verdict_comes_first_with_its_skips_and_details_shows_every_case(execution):
    from routetool.analysis.suite import Case
    from routetool.report.tables import Console
    from routetool.report.validate import render_validate

    import routetool_kernels

    cases = [c for c in QUICK if c.name.startswith("padding/")]
    result = validate(routetool_kernels.variant("tiled"), "tiled", execution, cases=cases)
    skipped = [c for c in result.cases if c.verdict == "skipped"]
    passed = [c for c in result.cases if c.verdict in ("pass", "pass_tie")]
    assert isinstance(cases[0], Case) and passed
    console = Console(width=100, record=True, color_system=None)
    render_validate(result, console)
    lines = console.export_text().splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith(("PASS", "FAIL", "NOTHING")))
    assert verdict < next(i for i, line in enumerate(lines) if "Verdicts by family" in line)
    expected = f"PASS: {len(passed)} of {len(cases)} cases passed"
    if skipped:
        expected += f", {len(skipped)} skipped ({skipped[0].message})"
    assert lines[verdict].startswith(expected), lines[verdict]
    assert "Every case" not in "\n".join(lines)
    console = Console(width=100, record=True, color_system=None)
    render_validate(result, console, details=True)
    text = console.export_text()
    assert "Every case" in text and all(c.name in text for c in result.cases)


def test_a_layer_of_zero_rows_is_skipped_not_passed(execution, tmp_path, make_trace):
    # a layer of zero token rows was "pass" though the kernel was never called: "PASS: 1 cases"
    empty = make_trace("t_empty.safetensors", {0: LayerArrays(gating_output=torch.zeros(0, 8))})
    src = _rejecting_kernels(tmp_path)
    res = CliRunner().invoke(main, ["validate", str(empty), "--suite", "none", "--kernel", f"{src}:must_not_be_called",
                                    "--device", DEVICE.type, "--no-progress", "--json", "-"])
    assert res.exit_code == 0, res.output
    case = json.loads(res.stdout)["cases"][0]
    assert (case["verdict"], case["description"]) == ("skipped", "layer 0: no token rows")
    assert case["message"] == "the layer holds no token rows: nothing to validate"
    assert "NOTHING CHECKED: the one case was skipped" in res.stderr and "PASS" not in res.stderr
    assert "suite none;" in res.stderr  # (it said "all 1 cases were skipped" and "suite -")
    # beside a layer with rows, the empty one is skipped and the other validated
    g = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    mixed = make_trace("mixed.safetensors", {0: LayerArrays(gating_output=torch.zeros(0, 8)),
                                             1: LayerArrays(gating_output=g)})
    result = validate(mutants.correct, "reference", execution, cases=[], traces=[mixed])
    assert [c.verdict for c in result.cases] == ["skipped", "pass"] and result.ok


def _mutant_path():
    return f"{ROOT / 'tests' / 'mutants.py'}:biased_weights"


def test_cli_json_and_junit(tmp_path):
    js, xml = tmp_path / "v.json", tmp_path / "v.xml"
    res = CliRunner().invoke(main, ["validate", "--kernel", _mutant_path(), "--family", "bias", "--family", "padding",
                                    "--device", DEVICE.type, "--json", str(js), "--junit", str(xml), "--no-progress"])
    assert res.exit_code == 1, res.output
    doc = json.loads(js.read_text())
    assert doc["schema"] == "routetool.validate/1" and doc["verdict"] == "fail"
    assert set(doc["families"]) == {"bias", "padding"}
    failed = [c for c in doc["cases"] if c["verdict"] == "fail"]
    assert failed and "weights_not_renormalized_unbiased" in failed[0]["failure_classes"]
    assert failed[0]["rows"][0]["top_inputs"][0]["expert"] == failed[0]["rows"][0]["expected_ids"][0]
    root = ET.parse(xml).getroot()
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"bias", "padding"}
    assert int(suites["bias"].get("failures")) == len([c for c in failed if c["family"] == "bias"])
    assert root.find(".//testcase/failure") is not None


def test_cli_passes_project_kernel_and_exit_codes(tmp_path):
    res = CliRunner().invoke(main, ["validate", "--family", "layouts", "--device", DEVICE.type, "--no-progress"])
    assert res.exit_code == 0 and "PASS" in res.output
    assert CliRunner().invoke(main, ["validate", "--suite", "none"]).exit_code == 2
    assert CliRunner().invoke(main, ["validate", "--family", "nope"]).exit_code == 2
    out = tmp_path / "keep.json"
    out.write_text("mine")
    res = CliRunner().invoke(main, ["validate", "--family", "layouts", "--json", str(out), "--no-progress"])
    assert res.exit_code == 2 and out.read_text() == "mine"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"junk")
    res = CliRunner().invoke(main, ["validate", str(bad), "--suite", "none", "--no-progress"])
    assert res.exit_code == 2 and "not a readable safetensors file" in res.output


def test_junit_holds_characters_xml_cannot(tmp_path):
    # a kernel's message (through the Python API) or a trace's file name may hold control
    # characters or lone surrogates; the JUnit file was written as is and did not parse
    # (a lone surrogate even stopped the write with a traceback)
    from routetool.report.formats import write_text
    from routetool.report.validate import validate_junit
    from routetool.analysis.validate import CaseResult, ValidateResult

    nasty = "bad \x00 \x1b[31mred \udc80 \ufffe end"
    cases = [CaseResult(family="fam\x01", name="fam/one\x1b", description="d", verdict="fail",
                        failure_classes=["crash"], message=nasty),
             CaseResult(family="fam\x01", name="fam/two", description="d", verdict="skipped", message=nasty),
             CaseResult(family="fam\x01", name="fam/three", description="d", verdict="pass_tie", message=nasty)]
    result = ValidateResult(kernel="k\x07", execution=select_execution("cuda" if HAS_CUDA else "cpu"), suite=None,
                            tie_ulps=16.0, cases=cases)
    out = tmp_path / "v.xml"
    write_text(validate_junit(result), str(out), None)
    root = ET.parse(out).getroot()
    shown = r"bad \x00 \x1b[31mred \udc80 \ufffe end"
    assert root.get("name") == r"routetool validate k\x07"
    suite = root.find("testsuite")
    assert suite.get("name") == r"fam\x01" and suite.get("failures") == "1"
    assert root.find(".//failure").get("message") == shown and root.find(".//failure").text == shown
    assert root.find(".//skipped").get("message") == shown and root.find(".//system-out").text == shown
    assert root.find(".//testcase").get("name") == r"fam/one\x1b"
    assert validate_junit(result).encode("utf-8")  # nothing left that UTF-8 cannot encode


def test_cli_junit_of_a_trace_whose_name_holds_control_characters(tmp_path, make_trace):
    import torch

    from routetool.io.trace import LayerArrays

    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    trace = make_trace("t\x1b[31m\x01.safetensors", {0: LayerArrays(gating_output=g)})
    xml = tmp_path / "v.xml"
    res = CliRunner().invoke(main, ["validate", str(trace), "--suite", "none", "--device", DEVICE.type,
                                    "--junit", str(xml), "--no-progress"])
    assert res.exit_code == 0, res.output
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite.get("name") == r"trace:t\x1b[31m\x01.safetensors" and suite.get("tests") == "1"
    # and a kernel whose exception text holds them
    src = tmp_path / "ctl.py"
    src.write_text("def boom(g, b, topk, route_scale, *a, **k):\n"
                   "    raise RuntimeError('bad \\x00 \\x1b[31mred \\udc80 end')\n")
    res = CliRunner().invoke(main, ["validate", str(trace), "--suite", "none", "--device", DEVICE.type,
                                    "--kernel", f"{src}:boom", "--junit", str(xml), "--force", "--no-progress"])
    assert res.exit_code == 1, res.output
    failure = ET.parse(xml).getroot().find(".//failure")
    assert failure.get("type") == "crash" and r"(RuntimeError: bad \x00 \x1b[31mred \udc80 end)" in failure.get("message")


def test_cli_one_trace_twice_is_refused_and_same_names_stay_apart(tmp_path, make_trace):
    # the same trace twice ran (and reported) every case twice under one name; two traces with
    # one file name in different folders shared their case names
    import torch

    from routetool.io.trace import LayerArrays

    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = make_trace("a/t.safetensors", {0: LayerArrays(gating_output=g)})
    b = make_trace("b/t.safetensors", {0: LayerArrays(gating_output=g)})
    res = CliRunner().invoke(main, ["validate", str(a), str(tmp_path / "b" / ".." / "a" / "t.safetensors"),
                                    "--suite", "none", "--device", DEVICE.type, "--no-progress"])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "the trace is given twice" in res.output and "(name each trace once)" in res.output
    out = tmp_path / "v.json"
    res = CliRunner().invoke(main, ["validate", str(a), str(b), "--suite", "none", "--device", DEVICE.type,
                                    "--json", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    names = [c["name"] for c in json.loads(out.read_text())["cases"]]
    assert len(names) == len(set(names)) == 2 and all(str(tmp_path) in n for n in names)


@pytest.mark.parametrize("command", ["validate", "replay", "balance"])
def test_a_kernel_without_the_seeds_signature_is_told_once(tmp_path, command, make_trace):
    # a kernel written without topk_weights=/topk_ids= was called and got 104 x rejected_undocumented
    # ("name bfloat16 in its docstring"): the signature is checked when the kernel is loaded, and the
    # error says so once, with the signature it must have
    src = tmp_path / "nobuf.py"
    src.write_text("from routetool_kernels.reference import musespark1x_routing_reference as ref\n"
                   "def fn(gating_output, bias, topk, route_scale, router_output_multiplier=None,\n"
                   "       router_score_normalization='sigmoid', router_score_division_eps=None, *, is_padding=None):\n"
                   "    raise AssertionError('never called')\n")
    trace = tmp_path / "t.safetensors"
    make_trace(trace, {0: LayerArrays(gating_output=torch.randn(4, 8), step_offsets=torch.tensor([0, 4]))})
    args = {"validate": ["--suite", "quick"], "replay": [str(trace)], "balance": [str(trace)]}[command]
    res = CliRunner().invoke(main, [command, *args, "--kernel", f"{src}:fn", "--device", DEVICE.type])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and "rejected" not in res.output and "bfloat16" not in res.output
    assert "wrong signature for --kernel (got an unexpected keyword argument 'topk_weights')" in lines[0]
    assert ("the seed's signature, fn(gating_output, bias, topk, route_scale, router_output_multiplier, "
            "router_score_normalization, router_score_division_eps, topk_weights, topk_ids, *, is_padding)") in lines[0]


@pytest.mark.parametrize("command", ["validate", "replay", "balance"])
def test_kernel_help_gives_the_signature(command):
    res = CliRunner().invoke(main, [command, "--help"], terminal_width=200)
    text = " ".join(res.output.split())
    assert ("fn(gating_output, bias, topk, route_scale, router_output_multiplier, router_score_normalization, "
            "router_score_division_eps, topk_weights, topk_ids, *, is_padding) -> (topk_weights, topk_ids)") in text


@pytest.mark.parametrize("name, classes", [
    # ignores the mask: the second call's outputs change with the bias, its padded rows are wrong
    # (it used to be reported stale_output, the headline of a padding bug)
    ("padding_ignored", ["invalid:bad_padding"]),
    # keeps the first call's mask and bias: the outputs did not change with their inputs
    ("stale_padding", ["stale_output"]),
])
def test_stale_output_only_when_outputs_did_not_change(name, classes, execution):
    case = next(c for c in build_suite("quick", ["padding"]) if c.name == "padding/mask-and-bias-change")
    result = validate(mutants.MUTANTS[name][0], name, execution, cases=[case])
    assert result.cases[0].failure_classes == classes


def test_a_random_tie_break_is_nondeterministic_not_row_order_dependence(execution):
    # a coin tossed per call agrees with itself half the time: one repeated call may see no
    # difference, and the call on rows in another order one. Over many seeds (the old check
    # misnamed 26 of 40), the row-order and batch comparisons are named only once each input
    # repeats its bits
    cases = [c for c in QUICK if "row_order" in c.checks]
    for seed in range(12):
        mutants.COINS.seed(seed)
        classes = _classes(validate(mutants.coin_toss_ties, "coin_toss_ties", execution, cases=cases))
        assert "nondeterministic" in classes and "row_order_dependence" not in classes, (seed, classes)


def test_the_quick_suite_routes_a_batch_above_256_tokens_on_every_device(execution):
    large = [c for c in QUICK if not c.cuda_only and c.build(torch.device("cpu")).gating_output.shape[0] > 256]
    assert large
    result = validate(mutants.floor_tiles_above_256, "floor_tiles_above_256", execution, cases=large)
    assert "invalid:duplicate_id" in _classes(result)


def test_verdict_line_counts_the_passes_within_ties(tmp_path):
    # a pass that holds only inside ties is weaker than an exact one: the verdict line counts it
    js = tmp_path / "v.json"
    res = CliRunner().invoke(main, ["validate", "--kernel", f"{ROOT / 'tests' / 'mutants.py'}:highest_index_ties",
                                    "--family", "ties", "--device", DEVICE.type, "--no-progress", "--json", str(js)],
                             terminal_width=80)
    assert res.exit_code == 0, res.output
    cases = [c for c in json.loads(js.read_text())["cases"] if c["verdict"] == "pass_tie"]
    assert cases
    text = " ".join(res.output.split())
    assert (f"cases passed ({len(cases)} only within ties: {sum(c['tie_rows'] for c in cases):,} rows differ from the "
            "reference inside a tie)") in text
