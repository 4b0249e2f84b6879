"""RouterSpec: its checks, its trace metadata, the kernels' keywords and the report's line, as the
trace reader, the reports and the kernels' call have them (the texts tests and golden outputs hold)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from routetool_kernels import reference
from routetool_kernels.spec import FIELD_INFO, MAX_EXPERTS, RouterSpec, SpecError
from routetool.engine.execution import SEED_SIGNATURE
from routetool.errors import RouteToolError
from routetool.io.trace import RouterConfig, TraceMeta, metadata_dict, parse_metadata

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"


def _golden_routers() -> dict[str, dict]:
    """Each golden report's JSON ``router`` object, by file name (one per distinct router)."""
    out = {}
    for path in sorted(GOLDEN.glob("*.json")):
        router = (json.loads(path.read_text()).get("json") or {}).get("router")
        if router is not None and router not in out.values():
            out[path.name] = router
    return out


GOLDEN_ROUTERS = _golden_routers()
# the header line of each golden router (report/tables.py router_line), by the first file that holds it
GOLDEN_LINES = {
    "replay-bundled.json": "E=256 topk=8 sigmoid route_scale=2.5 multiplier=None eps=None",
    "replay-deepseek.json": "E=256 topk=8 sigmoid route_scale=2.5 multiplier=None eps=1e-20",
    "replay-ids-only.json": "E=16 topk=2 sigmoid route_scale=1 multiplier=None eps=None",
    "replay-softmax.json": "E=20 topk=4 softmax route_scale=1 multiplier=None eps=1e-06",
    "replay-ties-biased-weights.json": "E=64 topk=6 sigmoid route_scale=2.5 multiplier=None eps=None",
}


def test_golden_routers_are_the_five_the_reports_show():
    assert sorted(GOLDEN_ROUTERS) == sorted(GOLDEN_LINES)


@pytest.mark.parametrize("name", sorted(GOLDEN_LINES))
def test_golden_router_round_trips_through_metadata_and_reports(name):
    doc = GOLDEN_ROUTERS[name]
    spec = RouterSpec(**doc)
    assert spec.problems() == []
    # the JSON object: the same six keys, the same values
    assert spec.document() == doc and list(spec.document()) == list(RouterSpec.DOCUMENT_KEYS)
    # the trace metadata: written as strings, read back to the same spec, through the trace reader too
    md = spec.to_metadata()
    assert all(isinstance(v, str) for v in md.values())
    assert RouterSpec.from_metadata(md) == spec
    meta = TraceMeta(model="m", router=spec, provenance="p")
    assert parse_metadata(Path("t.safetensors"), metadata_dict(meta, 2)) == meta
    # the report's header line
    assert spec.describe() == GOLDEN_LINES[name]


def test_metadata_keys_and_text():
    spec = RouterSpec(num_experts=256, topk=8, route_scale=2.5, router_score_division_eps=1e-20)
    assert spec.to_metadata() == {"num_experts": "256", "topk": "8", "route_scale": "2.5",
                                  "router_score_normalization": "sigmoid", "router_score_division_eps": "1e-20"}
    # route_scale is written as a float even when given as an int; the optional keys only when set
    assert RouterSpec(num_experts=4, topk=2, route_scale=2).to_metadata()["route_scale"] == "2.0"
    assert "router_output_multiplier" not in RouterSpec(num_experts=4, topk=2).to_metadata()
    # normalization defaults to sigmoid, other keys are not the spec's
    assert RouterSpec.from_metadata({"num_experts": "4", "topk": "2", "route_scale": "1.0", "model": "x"}) == \
        RouterSpec(num_experts=4, topk=2)
    assert RouterSpec.metadata_keys() >= {"num_experts", "topk", "route_scale", "router_score_normalization",
                                          "router_output_multiplier", "router_score_division_eps"}


def test_kernel_kwargs_are_the_seed_signatures_keywords():
    spec = RouterSpec(num_experts=8, topk=2, route_scale=2.5, router_output_multiplier=0.5,
                      router_score_normalization="softmax", router_score_division_eps=1e-6)
    assert spec.kernel_kwargs() == {"topk": 2, "route_scale": 2.5, "router_output_multiplier": 0.5,
                                    "router_score_normalization": "softmax", "router_score_division_eps": 1e-6}
    assert list(spec.kernel_kwargs()) == list(RouterSpec.KERNEL_KEYWORDS)
    # the seed's signature, in the order the keywords follow the logits and the bias
    assert SEED_SIGNATURE == ("fn(gating_output, bias, topk, route_scale, router_output_multiplier, "
                              "router_score_normalization, router_score_division_eps, topk_weights, topk_ids, *, "
                              "is_padding) -> (topk_weights, topk_ids)")
    assert RouterConfig is RouterSpec


# spec -> the problems today's trace reader names (io/trace.py router_config_errors), verbatim
PROBLEMS = [
    (dict(num_experts=0, topk=2), ["num_experts=0 must be in [1, 1,048,576]", "topk=2 must be in [1, num_experts=0]"]),
    (dict(num_experts=MAX_EXPERTS + 1, topk=2), ["num_experts=1,048,577 must be in [1, 1,048,576]"]),
    (dict(num_experts=8, topk=9), ["topk=9 must be in [1, num_experts=8]"]),
    (dict(num_experts=8, topk=0, route_scale=-1.0), ["topk=0 must be in [1, num_experts=8]",
                                                      "route_scale=-1.0 must be finite and > 0"]),
    (dict(num_experts=8, topk=2, route_scale=0.0), ["route_scale=0.0 must be finite and > 0"]),
    (dict(num_experts=8, topk=2, route_scale=math.inf), ["route_scale=inf must be finite and > 0"]),
    (dict(num_experts=8, topk=2, router_score_normalization="relu"),
     ["router_score_normalization='relu' must be sigmoid, softmax, sqrtsoftplus or topk_then_softmax"]),
    (dict(num_experts=8, topk=2, router_output_multiplier=math.nan), ["router_output_multiplier must be finite"]),
    (dict(num_experts=8, topk=2, router_score_division_eps=-1.0),
     ["router_score_division_eps=-1.0 must be finite and >= 0"]),
    (dict(num_experts=8, topk=8, route_scale=2.5, router_output_multiplier=0.0, router_score_division_eps=0.0), []),
    # grouping
    (dict(num_experts=8, topk=2, n_group=4), ["n_group and topk_group must be set together"]),
    (dict(num_experts=8, topk=2, n_group=3, topk_group=1), ["n_group=3 must divide num_experts=8 into equal groups"]),
    (dict(num_experts=8, topk=2, n_group=4, topk_group=5), ["topk_group=5 must be in [1, n_group=4]"]),
    (dict(num_experts=8, topk=3, n_group=4, topk_group=1), ["topk=3 must be at most the 2 experts of topk_group=1 groups"]),
    (dict(num_experts=8, topk=4, n_group=4, topk_group=2), []),
    # the weights of gpt-oss's router are a softmax over the picks: no renormalization to switch off, no eps
    (dict(num_experts=8, topk=2, router_score_normalization="topk_then_softmax", norm_topk_prob=False),
     ["norm_topk_prob=False must be unset under topk_then_softmax (its weights are a softmax over the picks)"]),
    (dict(num_experts=8, topk=2, router_score_normalization="topk_then_softmax", router_score_division_eps=1e-6),
     ["router_score_division_eps=1e-06 must be unset under topk_then_softmax (its weights are a softmax over the "
      "picks)"]),
    (dict(num_experts=8, topk=2, router_score_normalization="sqrtsoftplus", norm_topk_prob=False), []),
    (dict(num_experts=8, topk=2, norm_topk_prob="yes"), ["norm_topk_prob='yes' must be true or false"]),
    (dict(num_experts=8, topk=2, topk_method="group_limited_greedy"),
     ["topk_method=group_limited_greedy scores groups: set n_group and topk_group with it"]),
    (dict(num_experts=8, topk=2, n_group=4, topk_group=2, topk_method="greedy"),
     ["topk_method='greedy' must be noaux_tc or group_limited_greedy"]),
    (dict(num_experts=8, topk=2, n_group=4, topk_group=2, topk_method="group_limited_greedy"), []),
]


@pytest.mark.parametrize("kwargs, problems", PROBLEMS)
def test_problems(kwargs, problems):
    assert RouterSpec(**kwargs).problems() == problems


GOOD = {"num_experts": "8", "topk": "2", "route_scale": "1.0", "router_score_normalization": "sigmoid"}
# metadata -> the SpecError's text and fix, as the trace reader gave them before the spec held them
METADATA_ERRORS = [
    ({"num_experts": None}, "metadata key 'num_experts' is missing",
     "add num_experts=<E> to the metadata: E, the routed experts per layer: gating_output's columns; "
     "see docs/trace-format.md"),
    ({"topk": None}, "metadata key 'topk' is missing",
     "add topk=<K> to the metadata: K, the experts picked per token, 1 <= K <= num_experts; see docs/trace-format.md"),
    ({"route_scale": None}, "metadata key 'route_scale' is missing",
     "add route_scale=<factor> to the metadata: the factor on the renormalised weights, routed_scaling_factor, "
     "finite and > 0; 1 for none; see docs/trace-format.md"),
    ({"num_experts": "eight"}, "metadata num_experts='eight' is not a plain decimal integer",
     "write the value as a plain decimal integer (ASCII digits 0-9, e.g. 8; no decimal point, underscores, spaces "
     "or other scripts' digits)"),
    ({"topk": "2.5"}, "metadata topk='2.5' is not a plain decimal integer", None),
    ({"topk": ""}, "metadata topk='' is not a plain decimal integer", None),
    ({"num_experts": "9" * 5000}, f"metadata num_experts={'9' * 5000!r} is not a plain decimal integer", None),
    ({"route_scale": ""}, "metadata route_scale='' is empty, not a number", "write a plain decimal number"),
    ({"router_output_multiplier": ""}, "metadata router_output_multiplier='' is empty, not a number",
     "write a plain decimal number, or leave the key out for none"),
    ({"route_scale": "2_5"}, "metadata route_scale='2_5' is not a plain decimal number",
     "write the value as a plain decimal number (ASCII digits 0-9, e.g. 8 or 2.5; no underscores, spaces or other "
     "scripts' digits)"),
    ({"route_scale": "\u0662.\u0665"}, "metadata route_scale='\u0662.\u0665' is not a plain decimal number", None),
    ({"route_scale": "nan"}, "metadata route_scale='nan' is not finite", "write a finite number > 0 (1 for no scaling)"),
    ({"router_output_multiplier": "inf"}, "metadata router_output_multiplier='inf' is not finite",
     "write a finite number, or leave the key out for no multiplier"),
    ({"router_score_division_eps": "-inf"}, "metadata router_score_division_eps='-inf' is not finite",
     "write a finite number >= 0, or leave the key out for no eps"),
    ({"topk": "9"}, "topk=9 must be in [1, num_experts=8]", "fix the router parameters in the metadata"),
    ({"route_scale": "-1", "topk": "0"}, "topk=0 must be in [1, num_experts=8]; route_scale=-1.0 must be finite and > 0",
     "fix the router parameters in the metadata"),
    ({"router_score_normalization": "relu"},
     "router_score_normalization='relu' must be sigmoid, softmax, sqrtsoftplus or topk_then_softmax", None),
    ({"norm_topk_prob": "no"}, "metadata norm_topk_prob='no' is not true or false",
     "write true or false, or leave the key out for the default"),
]


@pytest.mark.parametrize("change, problem, fix", METADATA_ERRORS)
def test_metadata_errors(change, problem, fix):
    raw = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(SpecError) as err:
        RouterSpec.from_metadata(raw)
    assert err.value.problem == str(err.value) == problem
    if fix is not None:
        assert err.value.fix == fix
    # the trace reader's line: the file, the tensor, the problem and its fix
    with pytest.raises(RouteToolError) as err2:
        parse_metadata(Path("t.safetensors"), {"format": "routetool-trace", "format_version": "1", **raw})
    assert str(err2.value) == f"t.safetensors: __metadata__: {problem} ({err.value.fix})"


def test_grouping_travels_and_the_seed_signature_rejects_it():
    spec = RouterSpec(num_experts=8, topk=4, route_scale=2.5, n_group=4, topk_group=2)
    assert spec.problems() == [] and spec.grouped and spec.beyond_seed() == ["n_group"]
    assert RouterSpec.from_metadata(spec.to_metadata()) == spec  # the keys travel, only when set
    assert spec.to_metadata()["n_group"] == "4" and "n_group" not in RouterSpec(num_experts=8, topk=4).to_metadata()
    assert spec.document()["n_group"] == 4 and "n_group" not in RouterSpec(num_experts=8, topk=4).document()
    assert spec.describe().endswith(" n_group=4 topk_group=2")
    # a kernel of the seed's signature is passed the keywords it does not take: a rejection, not a silent plain top-k
    assert spec.kernel_kwargs()["n_group"] == 4
    g, bias = torch.randn(3, 8), torch.zeros(8)

    def seed_signature(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                       router_score_normalization="sigmoid", router_score_division_eps=None, *, is_padding=None):
        return reference.musespark1x_routing_reference(gating_output, bias, topk, route_scale)

    with pytest.raises(TypeError, match="n_group"):
        seed_signature(g, bias, **spec.kernel_kwargs())
    # the reference routes it, by keyword and by spec alike; a trace that declares it is read
    by_keyword = reference.musespark1x_routing_reference(g, bias, **spec.kernel_kwargs())
    assert all(torch.equal(a, b) for a, b in zip(by_keyword, reference.route(g, bias, spec)[:2]))
    meta = metadata_dict(TraceMeta(model="m", router=spec, provenance=""), 1)
    assert parse_metadata(Path("t.safetensors"), meta).router == spec
    with pytest.raises(SpecError, match="metadata n_group='2_0' is not a plain decimal integer"):
        RouterSpec.from_metadata({**GOOD, "n_group": "2_0", "topk_group": "1"})
    # an impossible grouping is refused by the reference's keywords too, in the spec's words
    with pytest.raises(ValueError, match=r"n_group=3 must divide num_experts=8 into equal groups"):
        reference.musespark1x_routing_reference(g, bias, 2, 1.0, n_group=3, topk_group=1)


def test_norm_topk_prob_has_one_spelling_per_router_and_travels():
    raw = RouterSpec(num_experts=8, topk=2, norm_topk_prob=False)
    # True is the seed's weights: the same spec as leaving it out (one router, one spec, one metadata)
    assert RouterSpec(num_experts=8, topk=2, norm_topk_prob=True) == RouterSpec(num_experts=8, topk=2)
    assert "norm_topk_prob" not in RouterSpec(num_experts=8, topk=2, norm_topk_prob=True).to_metadata()
    assert raw.to_metadata()["norm_topk_prob"] == "false" and RouterSpec.from_metadata(raw.to_metadata()) == raw
    assert RouterSpec.from_metadata({**GOOD, "norm_topk_prob": "True"}) == RouterSpec.from_metadata(GOOD)
    assert raw.kernel_kwargs()["norm_topk_prob"] is False and raw.beyond_seed() == ["norm_topk_prob"]
    assert raw.describe().endswith(" norm_topk_prob=False") and raw.document()["norm_topk_prob"] is False
    assert "norm_topk_prob" not in RouterSpec(num_experts=8, topk=2).kernel_kwargs()
    # the scoring functions beyond the seed's are named by their value, first the grouping
    both = RouterSpec(num_experts=8, topk=2, router_score_normalization="sqrtsoftplus", n_group=2, topk_group=1,
                      norm_topk_prob=False)
    assert both.beyond_seed() == ["n_group", "sqrtsoftplus", "norm_topk_prob"]
    assert RouterSpec(num_experts=8, topk=2, router_score_normalization="softmax").beyond_seed() == []


def test_topk_method_has_one_spelling_per_router_and_travels():
    greedy = RouterSpec(num_experts=8, topk=2, n_group=4, topk_group=2, topk_method="group_limited_greedy")
    plain = RouterSpec(num_experts=8, topk=2, n_group=4, topk_group=2)
    assert RouterSpec(num_experts=8, topk=2, n_group=4, topk_group=2, topk_method="noaux_tc") == plain
    assert RouterSpec.from_metadata(greedy.to_metadata()) == greedy and "topk_method" not in plain.to_metadata()
    assert greedy.describe().endswith(" n_group=4 topk_group=2 group_limited_greedy")
    assert greedy.kernel_kwargs()["topk_method"] == "group_limited_greedy" and greedy.beyond_seed() == ["n_group"]
    assert FIELD_INFO["topk_method"]["choices"] == ("noaux_tc", "group_limited_greedy")


def test_reference_entry_points_route_as_the_keyword_signature():
    spec = RouterSpec(num_experts=6, topk=3, route_scale=2.5, router_output_multiplier=0.5,
                      router_score_normalization="softmax", router_score_division_eps=1e-6)
    g = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    bias = torch.linspace(-0.1, 0.1, 6)
    pad = torch.tensor([False, True, False, False, False])
    got = reference.route(g, bias, spec, is_padding=pad)
    want = reference.routing_with_scores(g, bias, 3, 2.5, 0.5, "softmax", 1e-6, is_padding=pad)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(reference.scores(g, spec), reference.normalized_scores(g, "softmax", 0.5))
    with pytest.raises(ValueError, match="gating_output has 6 experts .*num_experts=8"):
        reference.route(g, bias, RouterSpec(num_experts=8, topk=3))


def test_differences_in_field_order():
    a = RouterSpec(num_experts=8, topk=2, route_scale=2.5)
    assert a.differences(a) == []
    b = RouterSpec(num_experts=8, topk=3, route_scale=1.0, router_score_division_eps=1e-20)
    assert a.differences(b) == ["topk", "route_scale", "router_score_division_eps"]


def test_field_metadata_names_an_option_and_help_for_every_field():
    for name, info in FIELD_INFO.items():
        assert info["option"].startswith("--") and info["help"], name
        assert info["kind"].rstrip("?") in ("int", "float", "str", "bool"), name
    for name, info in FIELD_INFO.items():  # a required key's missing-key message, a float's non-finite fix
        assert (info["required"] is not None) == (name in ("num_experts", "topk", "route_scale")), name
        assert bool(info["fix"]) == info["kind"].startswith("float"), name
    assert repr(RouterSpec(num_experts=4, topk=2)) == (
        "RouterSpec(num_experts=4, topk=2, route_scale=1.0, router_score_normalization='sigmoid', "
        "router_output_multiplier=None, router_score_division_eps=None)")


def test_spec_imports_no_torch():
    code = "import sys, routetool_kernels.spec; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.stdout.strip() == "[]", res.stderr


# -- where the parameters are spelled out ----------------------------------------------------------
def _router_names_in(path) -> set[str]:
    """The router parameters (other than the shape, num_experts and topk) that a module's code names:
    as a name, an attribute, a keyword, an argument or a string of its own (docstrings and comments
    aside)."""
    import ast

    wanted = set(RouterSpec.KERNEL_KEYWORDS[1:]) | set(RouterSpec.BEYOND_SEED)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.arg if isinstance(node, (ast.keyword, ast.arg))
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
        if name in wanted:
            found.add(name)
    return found


def test_the_router_parameters_are_spelled_out_in_at_most_eight_modules():
    # a module that names two or more of them spells the router out: adding a field may touch it.
    # The eight: the spec, the reference, the kernels' launchers and code (whose signatures are the
    # engines'), the validate suite's parameter cases and the Hugging Face config reader.
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spelled = sorted(str(p.relative_to(root)) for folder in ("routetool", "kernel") for p in (root / folder).rglob("*.py")
                     if len(_router_names_in(p)) >= 2)
    assert spelled == ["kernel/_launch.py", "kernel/reference.py", "kernel/routing.py", "kernel/routing_jit.py",
                       "kernel/seed.py", "kernel/spec.py", "routetool/analysis/suite.py", "routetool/capture/hf.py"]


def test_the_call_values_follow_the_fields_kinds():
    values = RouterSpec.call_values({"topk": 8.0, "route_scale": 2, "router_output_multiplier": None,
                                     "router_score_normalization": "softmax", "router_score_division_eps": 0})
    assert values == (8, 2.0, None, "softmax", 0.0) and [type(v) for v in values] == [int, float, type(None), str, float]
    assert RouterSpec.call_values(values) == values  # from a call's positional arguments too
    assert RouterSpec.from_call(16, values) == RouterSpec(num_experts=16, topk=8, route_scale=2.0,
                                                          router_score_normalization="softmax",
                                                          router_score_division_eps=0.0)
    with pytest.raises(ValueError):
        RouterSpec.call_values((8, 2.0, None, "softmax"))  # one short
    assert RouterSpec.call_defaults() == {"router_output_multiplier": None, "router_score_normalization": "sigmoid",
                                          "router_score_division_eps": None}
