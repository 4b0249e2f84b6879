"""Kernels vs the reference on fresh random inputs of awkward shapes, plus invariants and errors.

Runs compiled on a GPU and under the Triton interpreter on the CPU (sizes kept small).
"""

import pytest
import torch

from helpers import assert_routing_invariants
from kernel import fused_musespark1x_routing, fused_musespark1x_routing_seed, musespark1x_routing_reference
from kernel.reference import biased_scores, normalized_scores
from routetool.compare import RowClass, compare_step, weight_tolerance

SHAPES = [
    # (num_tokens, num_experts, topk): why the case is here
    (1, 256, 8),    # T=1: a single decode token, MuseSpark1x's expert count
    (33, 60, 4),    # non-power-of-two E and T (Qwen1.5-MoE's 60 experts); T not a multiple of BLOCK_T
    (5, 384, 8),    # E=384 (Kimi-K2): padded to 512 inside the kernel
    (4, 8, 8),      # topk == E: every expert is picked
    (3, 1, 1),      # E=1: the smallest router
    (17, 72, 1),    # topk=1, E=72
    (2, 512, 22),   # the largest padded E, a non-power-of-two topk
    (9, 160, 6),    # E=160 (DeepSeek-V2), topk=6
]

DTYPES = [
    # (gating dtype, weight tolerance): weights are float32 math in every case, so only
    # exp/sigmoid rounding differs between kernel and reference
    (torch.float32, 1e-5),
    (torch.bfloat16, 1e-5),
    (torch.float16, 1e-5),
]


def _inputs(T, E, dtype, device, seed, bias_scale=0.1):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn((T, E), generator=g) * 2).to(dtype).to(device)
    bias = (torch.randn(E, generator=g) * bias_scale).to(device)
    return logits, bias


def _check_against_reference(w, ids, logits, bias, topk, route_scale, rtol, is_padding=None, **kw):
    ref_w, ref_ids = musespark1x_routing_reference(logits, bias, topk, route_scale, is_padding=is_padding, **kw)
    scores = normalized_scores(logits, kw.get("router_score_normalization", "sigmoid"),
                               kw.get("router_output_multiplier"))
    cmp = compare_step(ids, w, ref_ids, ref_w, scores, biased_scores(scores, bias), is_padding,
                       tie_ulps=16, tolerance=weight_tolerance(torch.float32, route_scale))
    classes = torch.bincount(cmp.row_class.long(), minlength=len(RowClass))
    assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes.tolist()
    assert not cmp.weight_over_tol.any(), f"max weight error {float(cmp.weight_abs_err.max())}"
    # Where the boundary is not a near-tie, ids must agree exactly, order included.
    assert classes[RowClass.REORDERED] == 0
    return ref_w, ref_ids


@pytest.mark.parametrize("T,E,K", SHAPES)
@pytest.mark.parametrize("dtype,rtol", DTYPES)
def test_tiled_matches_reference(T, E, K, dtype, rtol, device):
    seed = hash((T, E, K, str(dtype))) % 2**31
    logits, bias = _inputs(T, E, dtype, device, seed)
    w, ids = fused_musespark1x_routing(logits, bias, K, 2.5)
    assert_routing_invariants(w, ids, E, K, 2.5)
    _check_against_reference(w, ids, logits, bias, K, 2.5, rtol)


@pytest.mark.parametrize("norm", ["sigmoid", "softmax"])
@pytest.mark.parametrize("multiplier,eps", [(None, None), (0.7, None), (None, 1e-3), (1.3, 0.5)])
def test_parameters(norm, multiplier, eps, device):
    T, E, K = 21, 96, 6
    logits, bias = _inputs(T, E, torch.float32, device, seed=7)
    pad = torch.zeros(T, dtype=torch.bool, device=device)
    pad[[0, 5, 20]] = True
    kw = dict(router_output_multiplier=multiplier, router_score_normalization=norm, router_score_division_eps=eps)
    w, ids = fused_musespark1x_routing(logits, bias, K, 1.7, is_padding=pad, **kw)
    assert_routing_invariants(w, ids, E, K, 1.7, is_padding=pad, eps=eps)
    _check_against_reference(w, ids, logits, bias, K, 1.7, 1e-5, is_padding=pad, **kw)
    ws, ids_s = fused_musespark1x_routing_seed(logits, bias, K, 1.7, is_padding=pad, **kw)
    _check_against_reference(ws, ids_s, logits, bias, K, 1.7, 1e-5, is_padding=pad, **kw)


@pytest.mark.parametrize("T,E,K", [(1, 256, 8), (33, 60, 4), (4, 8, 8), (5, 384, 8)])
def test_seed_variant_matches_reference_fp32(T, E, K, device):
    logits, bias = _inputs(T, E, torch.float32, device, seed=T * E + K)
    w, ids = fused_musespark1x_routing_seed(logits, bias, K, 2.5)
    assert_routing_invariants(w, ids, E, K, 2.5)
    _check_against_reference(w, ids, logits, bias, K, 2.5, 1e-5)


def test_ties_go_to_lowest_index(device):
    # Row 0: all logits equal -> experts 0..K-1. Row 1: integer logits, bf16-exact, with a
    # 4-way tie straddling the k-th boundary. Row 2: ties created by the bias.
    E, K = 12, 4
    logits = torch.zeros((3, E))
    logits[1] = torch.tensor([1, 3, 2, 2, 2, 3, 0, 2, 1, 0, 2, 1], dtype=torch.float32)
    logits[2] = 0.0
    bias = torch.zeros(E)
    bias_row2 = torch.tensor([0, 0.5, 0, 0.5, 0, 0, 0.5, 0, 0, 0.5, 0.5, 0])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).to(device)
        w, ids = fused_musespark1x_routing(x, bias.to(device), K, 1.0)
        assert ids[0].tolist() == [0, 1, 2, 3]
        assert ids[1].tolist() == [1, 5, 2, 3]  # 3,3 then the lowest two of the 2's
        w2, ids2 = fused_musespark1x_routing(x[2:3], bias_row2.to(device), K, 1.0)
        assert ids2[0].tolist() == [1, 3, 6, 9]
        assert torch.allclose(w2, torch.full_like(w2, 0.25))
        _, ref_ids = musespark1x_routing_reference(x, bias.to(device), K, 1.0)
        assert torch.equal(ref_ids[:2].cpu(), ids[:2].cpu())
    ws, ids_s = fused_musespark1x_routing_seed(logits.to(device), bias.to(device), K, 1.0)
    assert ids_s[:2].tolist() == [[0, 1, 2, 3], [1, 5, 2, 3]]


def test_nonfinite_rows_follow_the_safe_rule(device):
    E, K = 16, 4
    logits = torch.randn((6, E))
    logits[0] = float("nan")                 # all NaN
    logits[1, 3] = float("nan")              # some NaN
    logits[2] = float("-inf")                # all -inf
    logits[3, [2, 9]] = float("inf")         # +inf entries
    logits[4] = -1e4                         # every sigmoid underflows to 0
    logits[5, 0] = float("-inf")
    bias = torch.zeros(E)
    for norm in ("sigmoid", "softmax"):
        for eps in (None, 1e-6):
            x = logits.to(device)
            w, ids = fused_musespark1x_routing(x, bias.to(device), K, 2.0, router_score_normalization=norm,
                                               router_score_division_eps=eps)
            ref_w, ref_ids = musespark1x_routing_reference(x, bias.to(device), K, 2.0,
                                                           router_score_normalization=norm,
                                                           router_score_division_eps=eps)
            assert torch.isfinite(w).all()
            assert torch.equal(ids.cpu(), ref_ids.cpu()), (norm, eps)
            assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
            assert ids[0].tolist() == [0, 1, 2, 3]     # NaN counts as -inf: lowest indices
            assert 3 not in ids[1].tolist()            # the NaN expert is never preferred
            assert (w[0] == 0).all() and (w[2] == 0).all()
            if norm == "sigmoid":
                assert (w[4] == 0).all()               # 0 / 0 -> 0, not NaN
            if norm == "sigmoid":
                assert set(ids[3, :2].tolist()) == {2, 9}
            else:
                assert ids[3, :2].tolist() == [2, 9] and torch.allclose(w[3, :2].cpu(), torch.tensor([1.0, 1.0]))


def test_caller_buffers_layouts_and_int64_ids(device):
    T, E, K = 13, 64, 6
    wide = torch.randn((T, E + 7), device=device)
    logits = wide[:, 3:3 + E]                             # a column slice: row stride E + 7
    logits_t = torch.randn((E, T), device=device).t()     # a transposed view: column stride T
    bias = torch.randn(2 * E, device=device)[::2] * 0.1   # a strided bias
    for x in (logits, logits_t):
        ref_w, ref_ids = musespark1x_routing_reference(x, bias, K, 2.5)
        w_buf = torch.full((T + 5, K + 2), -7.0, device=device)
        id_buf = torch.full((T + 5, K + 2), -7, dtype=torch.int64, device=device)
        w, ids = fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w_buf, topk_ids=id_buf)
        assert w.data_ptr() == w_buf.data_ptr() and ids.dtype == torch.int64
        assert torch.equal(ids.cpu(), ref_ids.long().cpu())
        assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)
        assert (w_buf[T:] == -7).all() and (w_buf[:, K:] == -7).all(), "wrote outside the view"
        assert (id_buf[T:] == -7).all() and (id_buf[:, K:] == -7).all()


def test_empty_batch(device):
    w, ids = fused_musespark1x_routing(torch.empty((0, 32), device=device), torch.zeros(32, device=device), 4, 1.0)
    assert w.shape == (0, 4) and ids.shape == (0, 4)


BAD_CALLS = [
    # (kwargs overriding a valid call, expected message fragment)
    ({"gating_output": torch.zeros(8)}, "2-D"),
    ({"gating_output": torch.zeros((2, 8), dtype=torch.int32)}, "dtype"),
    ({"bias": torch.zeros(7)}, "bias must be a 1-D tensor of num_experts=8"),
    ({"bias": torch.zeros((8, 1))}, "bias"),
    ({"topk": 0}, "outside [1, num_experts=8]"),
    ({"topk": 9}, "outside [1, num_experts=8]"),
    ({"router_score_normalization": "relu"}, "unknown router_score_normalization"),
    ({"route_scale": float("nan")}, "route_scale must be finite"),
    ({"route_scale": 0.0}, "route_scale must be > 0"),
    ({"router_score_division_eps": -1.0}, "must be >= 0"),
    ({"router_output_multiplier": float("inf")}, "router_output_multiplier must be finite"),
    ({"topk_weights": torch.zeros((1, 2))}, "too small"),
    ({"topk_weights": torch.zeros((2, 2), dtype=torch.float16)}, "expected float32"),
    ({"topk_ids": torch.zeros((2, 2), dtype=torch.int16)}, "expected int32 or int64"),
    ({"is_padding": torch.zeros(3, dtype=torch.bool)}, "is_padding must have shape (2,)"),
    ({"is_padding": torch.zeros(2)}, "torch.bool"),
]


@pytest.mark.parametrize("override,message", BAD_CALLS)
@pytest.mark.parametrize("launcher", [fused_musespark1x_routing, fused_musespark1x_routing_seed, musespark1x_routing_reference])
def test_launcher_errors(override, message, launcher):
    args = dict(gating_output=torch.zeros((2, 8)), bias=torch.zeros(8), topk=2, route_scale=1.0)
    args.update(override)
    if launcher is musespark1x_routing_reference and ("topk_weights" in override or "topk_ids" in override):
        pytest.skip("the reference allocates its own outputs")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        launcher(**args)


def test_seed_rejects_half_precision_gating():
    with pytest.raises(ValueError, match="tl.sigmoid/tl.exp"):
        fused_musespark1x_routing_seed(torch.zeros((2, 8), dtype=torch.bfloat16), torch.zeros(8), 2, 1.0)
