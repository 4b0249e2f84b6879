"""The one routing call (routetool.engine.router.Router): the kernel once per captured step, the
reference once per chunk, every call judged by the contract."""

import pytest
import torch

from routetool.engine.router import REFERENCE_NAME, Router
from routetool.engine.stream import Chunk
from routetool.errors import RouteToolError
from routetool_kernels.reference import musespark1x_routing_reference
from routetool_kernels.spec import RouterSpec

SPEC = RouterSpec(num_experts=8, topk=2, route_scale=2.5, router_score_division_eps=1e-20)


def _chunk(steps=(3, 1, 4), seed=0) -> Chunk:
    g = torch.randn((sum(steps), 8), generator=torch.Generator().manual_seed(seed))
    offsets = [0]
    for n in steps:
        offsets.append(offsets[-1] + n)
    pad = torch.zeros(sum(steps), dtype=torch.bool)
    pad[2] = True
    return Chunk(layer=3, first_step=5, start=0, offsets=offsets, gating_output=g, is_padding=pad,
                 recorded_ids=None, recorded_weights=None)


def _counting(calls):
    def kernel(gating_output, bias, topk, route_scale, router_output_multiplier=None,
               router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
               topk_ids=None, is_padding=None):
        calls.append(gating_output.shape[0])
        return musespark1x_routing_reference(gating_output, bias, topk, route_scale, router_output_multiplier,
                                             router_score_normalization, router_score_division_eps,
                                             is_padding=is_padding)
    return kernel


def test_a_kernel_routes_each_step_and_the_reference_the_chunk_with_the_same_outputs():
    chunk, bias, calls = _chunk(), torch.randn(8) * 0.1, []
    by_step = Router(SPEC, _counting(calls), "counting").route(chunk, bias)
    whole = Router.reference(SPEC).route(chunk, bias)
    assert calls == [3, 1, 4] and by_step.calls == 3 and whole.calls == 1
    assert torch.equal(by_step.ids, whole.ids) and torch.equal(by_step.weights, whole.weights)
    assert whole.ids[2].tolist() == [-1, -1]  # the padded row
    expected = musespark1x_routing_reference(chunk.gating_output, bias, is_padding=chunk.is_padding,
                                             **SPEC.kernel_kwargs())
    assert torch.equal(whole.ids, expected[1]) and Router.reference(SPEC).name == REFERENCE_NAME


def test_a_call_passes_the_spec_and_the_extra_keywords():
    seen = {}

    def kernel(gating_output, bias, topk_weights=None, topk_ids=None, is_padding=None, **kwargs):
        seen.update(kwargs)
        return musespark1x_routing_reference(gating_output, bias, **{k: v for k, v in kwargs.items() if k != "use_pdl"})

    out = Router(SPEC, kernel).call(torch.randn(4, 8), torch.zeros(8), extra={"use_pdl": False})
    assert out.ok and seen == {**SPEC.kernel_kwargs(), "use_pdl": False}


def test_a_kernel_that_breaks_the_contract_is_named_by_its_step_and_one_that_writes_its_input_is_caught():
    def crashes_on_one_row(gating_output, bias, **kwargs):
        if gating_output.shape[0] == 1:
            raise RuntimeError("boom")
        return musespark1x_routing_reference(gating_output, bias, **{k: v for k, v in kwargs.items()
                                                                     if k not in ("topk_weights", "topk_ids")})

    routed = Router(SPEC, crashes_on_one_row, "fragile").route(_chunk(), torch.zeros(8))
    assert not routed.ok and routed.step == 6 and routed.outcome.failure_class == "crash"
    with pytest.raises(RouteToolError, match="layer 3, step 6"):
        Router(SPEC, crashes_on_one_row, "fragile").route_or_raise(_chunk(), torch.zeros(8), "t.safetensors")

    def writes_logits(gating_output, bias, **kwargs):
        out = musespark1x_routing_reference(gating_output, bias, **{k: v for k, v in kwargs.items()
                                                                    if k not in ("topk_weights", "topk_ids")})
        gating_output.zero_()
        return out

    routed = Router(SPEC, writes_logits).route(_chunk(), torch.zeros(8))
    assert not routed.ok and routed.outcome.failure_class == "modified_input"


def test_a_kernel_needs_whole_steps():
    piece = _chunk()
    piece.ends_step = False
    with pytest.raises(ValueError, match="whole steps"):
        Router(SPEC, _counting([])).route(piece, torch.zeros(8))
    assert Router.reference(SPEC).route(piece, torch.zeros(8)).ok  # the reference routes rows, not steps


def test_a_kernel_rejecting_an_option_beyond_the_seeds_signature_is_told_to_document_that_option():
    grouped = RouterSpec(num_experts=8, topk=2, n_group=4, topk_group=2)

    def seed_signature(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                       router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                       topk_ids=None, is_padding=None):
        """Plain top-k."""

    out = Router(grouped, seed_signature).call(torch.randn(3, 8), torch.zeros(8))
    assert out.failure_class == "rejected_undocumented" and "name n_group in its docstring" in out.fix
    seed_signature.__doc__ = "Plain top-k; n_group (group-limited routing) is not supported."
    assert Router(grouped, seed_signature).call(torch.randn(3, 8), torch.zeros(8)).failure_class == \
        "rejected_documented"


@pytest.mark.parametrize("spec, named, cls", [
    (RouterSpec(num_experts=8, topk=2, route_scale=1.0, n_group=4, topk_group=2), "n_group=4, topk_group=2",
     "KernelRejection"),
    (RouterSpec(num_experts=8, topk=2, route_scale=1.0, router_score_normalization="sqrtsoftplus"),
     "router_score_normalization='sqrtsoftplus'", "KernelRejection"),
    (RouterSpec(num_experts=8, topk=2, route_scale=1.0, norm_topk_prob=False), "norm_topk_prob=False", "KernelError"),
])
def test_a_kernel_rejecting_semantics_beyond_the_seeds_is_named_with_the_router_options(spec, named, cls):
    # the seed's signature rejects what it does not implement; the error names the router's options on
    # the trace's metadata (not the logits) and points to a kernel that implements them; a kernel whose
    # docstring does not name the option (here: norm_topk_prob) fails (exit 1) instead of exit 2
    def seed_only(gating_output, bias, topk, route_scale, router_output_multiplier=None,
                  router_score_normalization="sigmoid", router_score_division_eps=None, topk_weights=None,
                  topk_ids=None, *, is_padding=None):
        """The seed's semantics only: no n_group, no sqrtsoftplus."""
        if router_score_normalization not in ("sigmoid", "softmax"):
            raise ValueError(f"unknown router_score_normalization {router_score_normalization!r}")
        return musespark1x_routing_reference(gating_output, bias, topk, route_scale, is_padding=is_padding)

    with pytest.raises(RouteToolError) as info:
        Router(spec, seed_only, "seed-only").route_or_raise(_chunk(), torch.zeros(8), "t.safetensors")
    err = info.value
    assert type(err).__name__ == cls and err.tensor == "__metadata__", (type(err), err.tensor)
    assert f"seed-only does not implement the router's {named}" in str(err), str(err)
    assert "rejected layer 3, step 5" in str(err)
    if cls == "KernelRejection":
        assert "routetool_kernels.reference:musespark1x_routing_reference" in str(err)
    assert Router(spec, musespark1x_routing_reference).route_or_raise(_chunk(), torch.zeros(8), "t").ok
