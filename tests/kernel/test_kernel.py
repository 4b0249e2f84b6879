"""Kernels vs the reference on fresh random inputs of awkward shapes, plus invariants and errors.

Runs compiled on a GPU and under the Triton interpreter on the CPU (sizes kept small).
"""

import pytest
import torch

from helpers import assert_routing_invariants
from routetool_kernels import fused_musespark1x_routing, fused_musespark1x_routing_seed, musespark1x_routing_reference
from routetool_kernels._dispatch import clear_plans
from routetool_kernels.reference import biased_scores, normalized_scores
from routetool_kernels.routing_policy import LaunchConfig, default_config, padded_num_experts
from routetool.engine.compare import RowClass, compare_step, weight_tolerance

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


def two_level(E, K, block_t=1, width=32, programs_per_sm=2, num_warps=1):
    """A two-level launch config that fits (E, K): ``width`` columns, at least K of them.

    ``programs_per_sm=2`` makes the grid persistent on a GPU for all but tiny batches (the
    interpreter always runs one program per tile).
    """
    chunk = max(min(width, padded_num_experts(E)), 1 << (K - 1).bit_length())
    return LaunchConfig(block_t=block_t, chunk=chunk, num_warps=num_warps, algorithm="two_level",
                        programs_per_sm=programs_per_sm)


ROWS = LaunchConfig(block_t=32, chunk=1, num_warps=1, algorithm="rows")
ROWS_LANES2 = LaunchConfig(block_t=16, chunk=2, num_warps=1, algorithm="rows")  # 2 threads a token, one warp
ROWS_LANES4 = LaunchConfig(block_t=16, chunk=4, num_warps=2, algorithm="rows")  # 4 threads a token


def launch_configs(E, K, norm="sigmoid"):
    """The default launch, two-level ones (one and two tokens per tile, one token per warp, 32 and 64 columns) and
    the rows algorithm where it applies (sigmoid, topk <= 8, <= 256 experts)."""
    out = [("default", None), ("two_level", two_level(E, K)), ("two_level_bt2", two_level(E, K, block_t=2)),
           ("two_level_4warps", two_level(E, K, block_t=4, num_warps=4))]
    if padded_num_experts(E) >= 64 and K <= 64:
        out.append(("two_level_w64", two_level(E, K, width=64)))
    if norm == "sigmoid" and K <= 8 and E <= 256:
        out += [("rows", ROWS), ("rows_lanes4", ROWS_LANES4)]
    return out


@pytest.mark.parametrize("T,E,K", SHAPES)
@pytest.mark.parametrize("dtype,rtol", DTYPES)
@pytest.mark.parametrize("launch", ["default", "two_level", "two_level_bt2", "two_level_4warps", "two_level_w64",
                                    "rows", "rows_lanes4"])
def test_tiled_matches_reference(T, E, K, dtype, rtol, launch, device):
    configs = dict(launch_configs(E, K))
    if launch not in configs:
        pytest.skip(f"{launch} does not fit E={E}")
    seed = hash((T, E, K, str(dtype))) % 2**31
    logits, bias = _inputs(T, E, dtype, device, seed)
    w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=configs[launch])
    assert_routing_invariants(w, ids, E, K, 2.5)
    _check_against_reference(w, ids, logits, bias, K, 2.5, rtol)


@pytest.mark.parametrize("norm", ["sigmoid", "softmax"])
@pytest.mark.parametrize("multiplier,eps", [(None, None), (0.7, None), (None, 1e-3), (1.3, 0.5), (-0.7, None)])
def test_parameters(norm, multiplier, eps, device):
    # E=96: the scan tile pads to 128 and 64 columns leave a ragged last slice, so padding
    # experts meet the (negative) multiplier.
    T, E, K = 21, 96, 6
    logits, bias = _inputs(T, E, torch.float32, device, seed=7)
    pad = torch.zeros(T, dtype=torch.bool, device=device)
    pad[[0, 5, 20]] = True
    kw = dict(router_output_multiplier=multiplier, router_score_normalization=norm, router_score_division_eps=eps)
    for _, config in launch_configs(E, K, norm):
        w, ids = fused_musespark1x_routing(logits, bias, K, 1.7, is_padding=pad, config=config, **kw)
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
    for dtype, (_, config) in ((d, c) for d in (torch.float32, torch.bfloat16) for c in launch_configs(E, K)):
        x = logits.to(dtype).to(device)
        w, ids = fused_musespark1x_routing(x, bias.to(device), K, 1.0, config=config)
        assert ids[0].tolist() == [0, 1, 2, 3]
        assert ids[1].tolist() == [1, 5, 2, 3]  # 3,3 then the lowest two of the 2's
        w2, ids2 = fused_musespark1x_routing(x[2:3], bias_row2.to(device), K, 1.0, config=config)
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
    for norm, eps, (_, config) in ((n, e, c) for n in ("sigmoid", "softmax") for e in (None, 1e-6)
                                   for c in launch_configs(E, K, n)):
        if True:
            x = logits.to(device)
            w, ids = fused_musespark1x_routing(x, bias.to(device), K, 2.0, router_score_normalization=norm,
                                               router_score_division_eps=eps, config=config)
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
    for x, (_, config) in ((x, c) for x in (logits, logits_t) for c in launch_configs(E, K)):
        ref_w, ref_ids = musespark1x_routing_reference(x, bias, K, 2.5)
        w_buf = torch.full((T + 5, K + 2), -7.0, device=device)
        id_buf = torch.full((T + 5, K + 2), -7, dtype=torch.int64, device=device)
        w, ids = fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w_buf, topk_ids=id_buf, config=config)
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
def test_launcher_errors(override, message, launcher, device):
    args = dict(gating_output=torch.zeros((2, 8), device=device), bias=torch.zeros(8, device=device), topk=2,
                route_scale=1.0)
    launcher(**args)  # a valid call first: its plan must not let the bad call through
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in override.items()})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        launcher(**args)


EQUAL_BUT_WRONG = [
    # (a valid call's arguments, an override equal to one of them in Python but of a type the
    # checks refuse, the message): a plan keyed by value alone would let the second call through
    (dict(topk=1), {"topk": True}, "topk must be an int, got bool"),
    (dict(route_scale=1.0), {"route_scale": True}, "route_scale must be a Python float, got bool"),
    (dict(router_output_multiplier=1.0), {"router_output_multiplier": True}, "must be a Python float, got bool"),
    (dict(router_score_division_eps=0.0), {"router_score_division_eps": False}, "must be a Python float, got bool"),
]


@pytest.mark.parametrize("valid,override,message", EQUAL_BUT_WRONG)
@pytest.mark.parametrize("launcher", [fused_musespark1x_routing, fused_musespark1x_routing_seed])
def test_a_value_of_another_type_is_a_new_signature(valid, override, message, launcher, device):
    args = {**dict(gating_output=torch.zeros((2, 8), device=device), bias=torch.zeros(8, device=device), topk=2,
                   route_scale=1.0), **valid}
    launcher(**args)
    with pytest.raises(ValueError, match=message):
        launcher(**{**args, **override})


def test_a_config_equal_to_a_valid_one_but_of_float_fields_is_checked(device):
    # LaunchConfig(chunk=32.0) == LaunchConfig(chunk=32): the plan key tells them apart by type
    x, bias = torch.zeros((2, 64), device=device), torch.zeros(64, device=device)
    fused_musespark1x_routing(x, bias, 4, 1.0, config=LaunchConfig(block_t=1, chunk=32, num_warps=1))
    with pytest.raises(ValueError, match="chunk=32.0 must be an int"):
        fused_musespark1x_routing(x, bias, 4, 1.0, config=LaunchConfig(block_t=1, chunk=32.0, num_warps=1))


@pytest.mark.parametrize("launcher, module", [(fused_musespark1x_routing, "routing"), (fused_musespark1x_routing_seed,
                                                                                        "seed")])
def test_a_signature_is_checked_once_and_its_plan_serves_later_calls(launcher, module, device, monkeypatch):
    # Same shapes, dtypes, strides, buffers and parameters with new data (new tensors, new values
    # in the same buffers, new padding): checked once, every call right.
    import routetool_kernels.routing
    import routetool_kernels.seed

    mod = {"routing": routetool_kernels.routing, "seed": routetool_kernels.seed}[module]
    clear_plans()  # (another test may have left a plan of this signature)
    checks = []
    real_check = mod.check_routing_args
    monkeypatch.setattr(mod, "check_routing_args", lambda *a, **k: checks.append(1) or real_check(*a, **k))
    T, E, K = 9, 40, 4
    w_buf = torch.full((T, K), -7.0, device=device)
    id_buf = torch.full((T, K), -7, dtype=torch.int32, device=device)
    for rep in range(4):
        logits, bias = _inputs(T, E, torch.float32, device, seed=100 + rep)
        pad = torch.rand(T, generator=torch.Generator().manual_seed(rep)) < 0.3
        pad = pad.to(device)
        w, ids = launcher(logits, bias, K, 2.5, topk_weights=w_buf, topk_ids=id_buf, is_padding=pad,
                          router_score_normalization="softmax")
        assert w.data_ptr() == w_buf.data_ptr() and ids.data_ptr() == id_buf.data_ptr()
        _check_against_reference(w, ids, logits, bias, K, 2.5, 1e-5, is_padding=pad,
                                 router_score_normalization="softmax")
        w2, ids2 = launcher(logits, bias, K, 2.5, is_padding=pad, router_score_normalization="softmax")
        assert torch.equal(ids2, ids) and torch.equal(w2, w) and ids2.data_ptr() != ids.data_ptr()
    assert len(checks) == 2, "one check per signature (caller buffers, allocated outputs)"


def test_plans_keep_every_layout_apart(device):
    # Strides, a larger caller buffer, int64 ids, an offset view (another pointer alignment) and
    # the bias's stride are all in the key: each call is right after any other.
    import routetool_kernels.routing

    T, E, K = 7, 48, 5
    wide = torch.randn((T, E + 5), device=device)
    flat = torch.randn(T * E + 1, device=device)
    bias = torch.randn(2 * E, device=device)[::2] * 0.1
    layouts = [
        ("contiguous", wide[:, :E].contiguous(), bias.contiguous(), None),
        ("row slice", wide[:, 1:1 + E], bias, None),
        ("transposed", torch.randn((E, T), device=device).t(), bias, None),
        ("offset by one element", flat[1:].view(T, E), bias.contiguous(), None),
        ("larger int64 buffers", wide[:, :E].contiguous(), bias, (torch.full((T + 3, K + 1), -7.0, device=device),
                                                                 torch.full((T + 3, K + 1), -7, dtype=torch.int64,
                                                                            device=device))),
    ]
    clear_plans()
    for rep in range(2):
        for name, x, b, bufs in layouts:
            w_buf, id_buf = bufs if bufs else (None, None)
            w, ids = fused_musespark1x_routing(x, b, K, 2.5, topk_weights=w_buf, topk_ids=id_buf)
            ref_w, ref_ids = musespark1x_routing_reference(x, b, K, 2.5)
            assert torch.equal(ids.long().cpu(), ref_ids.long().cpu()), name
            assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6), name
            if bufs:
                assert w.shape == (T, K) and ids.dtype == torch.int64
                assert (w_buf[T:] == -7).all() and (w_buf[:, K:] == -7).all() and (id_buf[T:] == -7).all()
        assert len(routetool_kernels.routing._PLANS) == len(layouts), rep  # one plan each, found again the second time


def test_the_plan_cache_is_bounded_and_can_be_cleared(device, monkeypatch):
    from routetool_kernels import _dispatch, routing

    monkeypatch.setattr(_dispatch, "MAX_PLANS", 2)
    clear_plans()
    bias = torch.zeros(16, device=device)
    for T in (1, 2, 3, 4):
        w, ids = fused_musespark1x_routing(torch.randn((T, 16), device=device), bias, 2, 1.0)
        assert ids.shape == (T, 2)
        assert len(routing._PLANS) <= 2
    clear_plans()
    assert len(routing._PLANS) == 0


def test_an_empty_batch_has_a_plan_too(device):
    for _ in range(2):
        w, ids = fused_musespark1x_routing(torch.empty((0, 32), device=device), torch.zeros(32, device=device), 4, 1.0,
                                           topk_weights=torch.empty((3, 4), device=device),
                                           topk_ids=torch.empty((3, 4), dtype=torch.int32, device=device))
        assert w.shape == (0, 4) and ids.shape == (0, 4)


def test_seed_rejects_half_precision_gating():
    with pytest.raises(ValueError, match="tl.sigmoid/tl.exp"):
        fused_musespark1x_routing_seed(torch.zeros((2, 8), dtype=torch.bfloat16), torch.zeros(8), 2, 1.0)


def test_two_level_redoes_tiles_where_a_column_holds_three_picks(device):
    # Column 0 of 32 (experts 0, 32, 64, 96) holds the four best experts of row 0, so the
    # per-column best two cannot prove the top-k: the tile must be redone by the scan.
    # Row 1 puts the k-th pick's tie into one column; row 2 is random (no redo needed); in
    # row 3 all eight picks are equal keys of column 0 (equal logits, bias 0 there, far
    # behind elsewhere), so the redo must order them by expert index.
    T, E, K = 4, 256, 8
    logits, bias = _inputs(T, E, torch.float32, device, seed=11, bias_scale=0.01)
    logits[0] = logits[0].clamp(-2.0, 2.0) * 0.5 - 3.0
    logits[0, [0, 32, 64, 96]] = torch.tensor([3.0, 2.0, 1.0, 0.0], device=device)
    logits[1] = 0.0
    logits[1, [5, 37, 69]] = 4.0            # a 3-way tie in column 5 ...
    logits[1, [1, 2, 3, 4, 6]] = 5.0        # ... behind five better experts: the tie decides picks 6-8
    column0 = torch.arange(E, device=device) % 32 == 0
    logits[3] = torch.where(column0, 0.0, -10.0)
    bias[column0] = 0.0
    for block_t, num_warps in ((1, 1), (2, 1), (2, 2), (4, 4)):
        config = two_level(E, K, block_t=block_t, num_warps=num_warps)
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=config)
        assert_routing_invariants(w, ids, E, K, 2.5)
        assert ids[0, :4].tolist() == [0, 32, 64, 96]
        assert ids[3].tolist() == list(range(0, E, 32))
        ref_w, ref_ids = musespark1x_routing_reference(logits, bias, K, 2.5)
        assert torch.equal(ids.cpu(), ref_ids.cpu())
        assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def test_two_level_ties_between_columns_go_to_the_lowest_expert(device):
    # Equal keys in different columns: the one-reduction merge pops them together, which
    # sends the tile to the redo; the ids must still follow the lowest-index rule exactly.
    T, E, K = 5, 256, 8
    logits, bias = _inputs(T, E, torch.float32, device, seed=5)
    bias.zero_()
    logits[0] = 0.0                                    # every key equal: experts 0..7
    logits[1] = -4.0
    logits[1, [200, 9, 70, 41]] = 2.0                  # a 4-way tie for the first picks, 4 columns
    logits[1, [100, 3, 12, 33, 250]] = 1.0             # 5-way tie for the last four picks
    logits[2] = logits[2].to(torch.bfloat16).float()   # bf16-rounded logits, no bias: many exact ties
    logits[3] = torch.randint(-3, 4, (E,), device=device).float()  # seven values over 256 experts
    expected = {0: list(range(8)), 1: [9, 41, 70, 200, 3, 12, 33, 100]}
    for block_t, num_warps, width in ((1, 1, 32), (2, 1, 32), (4, 4, 32), (1, 1, 64)):
        config = two_level(E, K, block_t=block_t, num_warps=num_warps, width=width)
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=config)
        assert_routing_invariants(w, ids, E, K, 2.5)
        for row, want in expected.items():
            assert ids[row].tolist() == want, (config, row)
        ref_w, ref_ids = musespark1x_routing_reference(logits, bias, K, 2.5)
        assert torch.equal(ids.cpu(), ref_ids.cpu()), config
        assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("E,K", [(8, 8), (33, 32), (40, 8), (64, 8), (100, 20), (128, 32)])
def test_two_level_all_keys_equal_with_few_slices(E, K, device):
    # At most two slices per column: ties empty every column's pair before the k-th round,
    # so columns pop a third time; the kernel must still see the row as unproven and redo it.
    logits = torch.zeros((3, E), device=device)
    logits[1] = 1.0
    logits[2, : E // 2] = 2.0                        # ties in the first half only
    bias = torch.zeros(E, device=device)
    for width in (32, 64):
        for block_t, num_warps in ((1, 1), (2, 2)):
            config = two_level(E, K, block_t=block_t, num_warps=num_warps, width=width)
            w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=config)
            assert_routing_invariants(w, ids, E, K, 2.5)
            _, ref_ids = musespark1x_routing_reference(logits, bias, K, 2.5)
            assert torch.equal(ids.cpu(), ref_ids.cpu()), config


@pytest.mark.parametrize("T,E,K", [(7, 256, 8), (6, 100, 32), (5, 40, 8), (4, 33, 3)])
def test_two_level_ragged_columns_and_many_picks(T, E, K, device):
    # E not a multiple of the columns (masked last slice), topk up to the column count, and
    # rows whose picks crowd into few columns (bias favouring one column).
    logits, bias = _inputs(T, E, torch.float32, device, seed=E + K)
    bias[torch.arange(E) % 32 == 3] += 0.6
    for width in (32, 64):
        config = two_level(E, K, width=width)
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=config)
        assert_routing_invariants(w, ids, E, K, 2.5)
        _check_against_reference(w, ids, logits, bias, K, 2.5, 1e-5)


@pytest.mark.parametrize("E,K,dtype,redo_own", [(256, 8, torch.bfloat16, 0), (60, 6, torch.float32, 0),
                                                 (130, 8, torch.float16, 0), (256, 8, torch.bfloat16, 1),
                                                 (60, 6, torch.float32, 1)])
def test_rows_window_keys_and_their_redo(E, K, dtype, redo_own, device, monkeypatch, request):
    # The rows algorithm orders experts by window keys (score bits above a power of two chosen from the bias,
    # the expert in the low bits) and routes a tile again with exact keys where a pick falls below the window,
    # a logit or a bias is NaN (through the launch's own loads, or with ROWS_REDO_OWN_LOADS each thread's own
    # pieces one chunk at a time). Each case below must give the reference's ids and the scan's weight bits.
    from routetool_kernels import routing_policy

    request.addfinalizer(clear_plans)
    monkeypatch.setattr(routing_policy, "ROWS_REDO_OWN_LOADS", redo_own)
    clear_plans()
    T = 40  # two programs of 32 rows, the second partly past the end
    logits, bias = _inputs(T, E, dtype, device, seed=E + K)
    logits[0] = 0.0                                          # every score 0.5, the window's bottom with bias 0
    logits[1] = logits[1].to(torch.bfloat16).round().to(dtype)  # integer logits: exact ties across the k-th pick
    logits[2, :5] = float("nan")                             # NaN logits count as score 0
    logits[3] = -30.0                                        # scores far below the window
    logits[4, 7] = float("inf")
    logits[5] = float("-inf")
    scan = LaunchConfig(block_t=8, chunk=8, num_warps=1)
    inf_bias = bias.clone()
    inf_bias[[3, 40, 50]] = float("inf")                     # a window ending above +inf; the rest below it
    nan_bias = bias.clone()
    nan_bias[[1, 9]] = float("nan")                          # NaN bias counts as -inf
    biases = (bias, inf_bias, torch.zeros_like(bias), bias - 2.0, bias + 3.0, nan_bias, bias.to(torch.bfloat16))
    for i, b in enumerate(biases):
        b = b.to(device)
        _, ref_ids = musespark1x_routing_reference(logits, b, K, 2.5)
        w_scan, ids_scan = fused_musespark1x_routing(logits, b, K, 2.5, config=scan)
        for rows in (ROWS, ROWS_LANES4) if i < 2 else (ROWS,):  # (4 threads a token: the lanes' merge)
            w, ids = fused_musespark1x_routing(logits, b, K, 2.5, config=rows)
            assert torch.equal(ids.cpu(), ref_ids.int().cpu()), (b, rows)
            assert torch.equal(ids, ids_scan) and torch.equal(w.view(torch.int32), w_scan.view(torch.int32)), (b, rows)


@pytest.mark.parametrize("ahead,tile,words,redo_own", [(1, 0, 0, 0), (2, 0, 1, 0), (3, 0, 1, 0), (4, 0, 1, 0),
                                                       (4, 0, 0, 0), (1, 1, 1, 0), (2, 2, 1, 0), (1, 4, 1, 0),
                                                       (1, 8, 0, 0), (1, 2, 0, 0), (4, 0, 1, 1), (1, 4, 1, 1),
                                                       (1, 2, 0, 1)])
def test_rows_launch_switches_change_no_bit(ahead, tile, words, redo_own, device, monkeypatch, request):
    # a thread of the rows algorithm loads its logits 1, 2 or 4 chunks ahead of the one it sorts (where it takes at
    # least ROWS_AHEAD_FROM chunks: the most of ROWS_AHEAD that divides its iterations: 3 gives 2) or from
    # coalesced tiles, and reads bf16 logits as words of two or one by one (its picks' logits are read before the
    # redo vote, again after a redo); the ids and
    # weights are the scan's bits for each, incl. NaN logits (the redo loads ahead too; one in the last program,
    # whose rows past the batch read the last row) and a partial last chunk
    from routetool_kernels import routing_policy

    request.addfinalizer(clear_plans)
    # 8 chunks, the last half empty: 8 iterations with one thread a token, 4 with two (one step of 4 ahead), 2
    # with four
    E, K, T = 60, 8, 33
    logits, bias = _inputs(T, E, torch.bfloat16, device, seed=ahead)
    logits[5, 58] = float("nan")
    logits[32, 3] = float("nan")
    w_scan, ids_scan = fused_musespark1x_routing(logits, bias, K, 2.5, config=LaunchConfig(block_t=8, chunk=8,
                                                                                           num_warps=1))
    monkeypatch.setattr(routing_policy, "ROWS_AHEAD", ahead)
    monkeypatch.setattr(routing_policy, "ROWS_TILE", tile)
    monkeypatch.setattr(routing_policy, "ROWS_AHEAD_FROM", 1)  # (the 4 threads a token take 2 chunks each)
    monkeypatch.setattr(routing_policy, "ROWS_WORDS", words)
    monkeypatch.setattr(routing_policy, "ROWS_REDO_OWN_LOADS", redo_own)  # (the redo's loads: the same picks)
    clear_plans()
    for rows in (ROWS, ROWS_LANES2, ROWS_LANES4):
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, config=rows)
        assert torch.equal(ids, ids_scan) and torch.equal(w.view(torch.int32), w_scan.view(torch.int32)), rows


@pytest.mark.parametrize("E,redo_own", [(128, 0), (256, 0), (256, 1)])
def test_rows_tma_tiles_change_no_bit(E, redo_own, device, monkeypatch, request):
    # above ROWS_TMA_FROM tokens the rows kernel's tiles of bf16 logits and of the bias are copied by the
    # tensor-memory accelerator (here Triton's interpreted tensor descriptors): the scan's bits for every token, incl.
    # NaN logits (the redo reads through pointers), a padded row and the last program's rows past the batch (read as
    # zeros, kept out of the redo vote); the second call takes the plan, which builds the call's descriptors
    from routetool_kernels import routing, routing_policy

    request.addfinalizer(clear_plans)
    T, K = 33, 8
    logits, bias = _inputs(T, E, torch.bfloat16, device, seed=E)
    logits[5, 100] = float("nan")
    logits[32, 3] = float("nan")
    pad = torch.zeros(T, dtype=torch.bool, device=device)
    pad[7] = True
    w_scan, ids_scan = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad,
                                                 config=LaunchConfig(block_t=8, chunk=16, num_warps=1))
    monkeypatch.setattr(routing_policy, "ROWS_TMA_FROM", 16)
    monkeypatch.setattr(routing_policy, "ROWS_REDO_OWN_LOADS", redo_own)
    clear_plans()
    for rows in (ROWS_LANES2, ROWS_LANES4):
        assert routing._row_tma(logits, bias, T, rows.chunk)
        for _ in range(2):
            w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad, config=rows)
            assert torch.equal(ids, ids_scan) and torch.equal(w.view(torch.int32), w_scan.view(torch.int32)), rows


def test_rows_tma_takes_only_what_its_copies_can_read(device, monkeypatch):
    # the accelerator's copies need 16-byte aligned rows of whole tiles and a contiguous, aligned bias; anything
    # else takes the threads' own loads (what a plan's key holds: strides, shapes, each pointer's 16-byte alignment)
    from routetool_kernels import routing, routing_policy

    monkeypatch.setattr(routing_policy, "ROWS_TMA_FROM", 16)
    buf = torch.zeros(40 * 264 + 8, device=device).to(torch.bfloat16)
    logits = buf[:40 * 256].view(40, 256)
    bias = torch.zeros(260, device=device)
    assert routing._row_tma(logits, bias[:256], 40, 2)
    assert not routing._row_tma(logits, bias[:256], 16, 2)  # not above ROWS_TMA_FROM tokens
    assert not routing._row_tma(logits, bias[1:257], 40, 2)  # bias 4 bytes past an aligned start
    assert not routing._row_tma(logits, torch.zeros(512, device=device)[::2], 40, 2)  # a strided bias
    assert not routing._row_tma(buf[:40 * 260].view(40, 260)[:, :256], bias[:256], 40, 2)  # rows of 520 bytes
    assert not routing._row_tma(logits[:, :192], bias[:192], 40, 4)  # 192 experts: not whole tiles of 128
    assert not routing._row_tma(logits.float(), bias[:256], 40, 2)  # float32 logits: the threads' own loads
    monkeypatch.setattr(routing_policy, "ROWS_TMA_FROM", 0)
    assert not routing._row_tma(logits, bias[:256], 40, 2)  # 0: never


def test_rows_tma_plans_keep_descriptors_by_address_and_hold_no_tensor(device):
    # a direct launch of a TMA plan takes kept descriptors: the call's addresses with the first call's shape,
    # strides and blocks (what Triton's launcher reads of a descriptor: its base's data_ptr(), shape, strides,
    # padding), one pair per address pair, built once; the kept ones reference no tensor
    import gc
    import weakref

    from routetool_kernels import routing

    blocks = ((16, 32), (1, 64))
    first, bias = torch.zeros((40, 256), device=device).to(torch.bfloat16), torch.zeros(256, device=device)
    kept = routing.RowDescriptors(blocks, first, bias)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    for _ in range(2):
        x = torch.ones((40, 256), device=device).to(torch.bfloat16)
        a, b = kept.direct(x, bias)
        ja, jb = kept.jit(x, bias)
        assert (a.base.data_ptr(), b.base.data_ptr()) == (x.data_ptr(), bias.data_ptr())
        for d, j in ((a, ja), (b, jb)):
            assert (list(d.shape), list(d.strides), list(d.block_shape), d.padding) == \
                (list(j.shape), list(j.strides), list(j.block_shape), j.padding)
        assert kept.direct(x, bias)[0] is a and not isinstance(a.base, torch.Tensor)
        assert ja.base.data_ptr() == x.data_ptr() and ja.base.dtype == torch.int32
        del x, ja, jb
    assert len(kept._kept) <= 2


def test_rows_word_reads_follow_only_what_a_plan_key_holds(device):
    # a plan serves every call of its key, which holds each pointer's 16-byte alignment (not its 4-byte one):
    # bf16 logits are read as int32 words only from 16-byte aligned starts, so views 4 and 2 bytes past an
    # aligned start (one key) take the same path, each the scan's bits
    from routetool_kernels import routing
    from routetool_kernels._dispatch import call_signature

    buf = torch.randn(5 * 16 + 16, device=device).to(torch.bfloat16)
    aligned, four, two = (buf[k:k + 80].view(5, 16) for k in (0, 2, 1))
    assert (aligned.data_ptr() % 16, four.data_ptr() % 16, two.data_ptr() % 16) == (0, 4, 2)
    assert call_signature((four,), (), False)[0] == call_signature((two,), (), False)[0]
    assert routing._row_words(aligned) and not routing._row_words(four) and not routing._row_words(two)
    bias = torch.zeros(16, device=device)
    for x in (aligned, four, two):
        w_scan, ids_scan = fused_musespark1x_routing(x, bias, 4, 1.0, config=LaunchConfig(block_t=8, chunk=16,
                                                                                          num_warps=1))
        w, ids = fused_musespark1x_routing(x, bias, 4, 1.0, config=ROWS)
        assert torch.equal(ids, ids_scan) and torch.equal(w.view(torch.int32), w_scan.view(torch.int32))


def _policy_configs(E, K, dtype, norm="sigmoid"):
    """Every launch the policy picks on a GPU for batches on either side of each of its switches, plus the
    interpreter's own (a tile of rows): as the interpreter runs them, one program per tile (the persistent and
    claimed-tile loops route each tile with the same code as a one-tile program)."""
    from routetool_kernels import routing_policy as policy

    sizes = {1, policy.SMALL_BATCH, policy.SMALL_BATCH + 1, policy.PERSISTENT_FROM, policy.PERSISTENT_FROM + 1,
             65536} | {n for above in policy.rows_switches() | {0} for n in (above, above + 1)}
    configs = {default_config(n, E, dtype, "cuda", k, norm) for n in sizes for k in (K, policy.TWO_LEVEL_MAX_TOPK + 1)}
    configs.add(policy.two_level_config(65536, E, K))  # (also where the rows algorithm takes large batches)
    configs.add(default_config(7, E, dtype, "cpu", K))
    seen, out = set(), []
    for c in sorted(configs, key=repr):  # (persistence and claims do not change an interpreted launch)
        key = (c.algorithm, c.block_t, c.chunk, c.num_warps)
        if key not in seen and (c.algorithm in ("scan", "rows") or K <= c.chunk):
            seen.add(key)
            out.append(c)
    return out


def _model_shapes():
    from routetool.analysis.suite import MODEL_SHAPES
    from routetool_kernels.spec import RouterSpec

    # the shapes the kernel routes: each (E, K, scoring) once, those beyond the seed's semantics left out
    # (the kernel rejects them: tests/analysis/test_validate.py)
    shapes = {}
    for i, m in enumerate(MODEL_SHAPES):
        if not RouterSpec(num_experts=m.num_experts, topk=m.topk, **m.router()).beyond_seed():
            shapes.setdefault((m.num_experts, m.topk, m.normalization, m.dtype), (i, m))
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return [pytest.param(m.num_experts, m.topk, m.normalization, dtypes[(i + extras) % 3], extras,
                         id=f"{m.slug}-{str(dtypes[(i + extras) % 3])[6:]}-{'padding-bias' if extras else 'plain'}")
            for i, m in shapes.values() for extras in (0, 1)]


@pytest.mark.parametrize("E,K,norm,dtype,extras", _model_shapes())
def test_a_token_gets_the_same_bits_in_every_batch_and_launch(E, K, norm, dtype, extras, device):
    # One arithmetic for every algorithm and tile: a token routed alone and in a batch under each launch the
    # policy picks across its switches gives the same ids and weight bits (the interpreter is exact IEEE, so
    # any difference in the order of operations would show; routetool_kernels.routing_jit sums in fixed point).
    if device.type == "cuda":
        pytest.skip("on a GPU tests/kernel/test_gpu.py routes real batches across the switches")
    T = 6
    logits, bias = _inputs(T, E, dtype, "cpu", seed=E * 3 + K + extras)
    pad = torch.tensor([False, True, False, False, True, False]) if extras else None
    kw = dict(router_score_normalization=norm)
    if extras:
        kw.update(router_output_multiplier=1.7, router_score_division_eps=1e-20)
    else:
        bias = torch.zeros_like(bias)
    alone = [fused_musespark1x_routing(logits[r:r + 1].clone(), bias, K, 2.5, **kw) for r in (0, 3, 5)]
    for config in _policy_configs(E, K, dtype, norm):
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad, config=config, **kw)
        for r, (w1, ids1) in zip((0, 3, 5), alone):
            assert torch.equal(ids[r], ids1[0]), (config, r)
            assert torch.equal(w[r].view(torch.int32), w1[0].view(torch.int32)), (config, r, w[r] - w1[0])
        if pad is not None:
            assert (ids[pad] == -1).all() and (w[pad] == 0).all()


def test_default_config_by_shape():
    dec = default_config(64, 256, torch.float32)
    assert dec.algorithm == "scan" and dec.block_t == 1
    pre = default_config(65536, 256, torch.bfloat16, normalization="softmax")
    assert pre.algorithm == "two_level" and pre.chunk == 32 and pre.programs_per_sm > 0 and pre.dynamic_tiles
    assert not default_config(3000, 256, torch.float32, normalization="softmax").dynamic_tiles  # nothing to claim
    rows = default_config(65536, 256, torch.bfloat16)  # sigmoid, topk <= 8, <= 256 experts
    assert rows.algorithm == "rows" and rows.block_t * rows.chunk == 32 * rows.num_warps and rows.chunk == 2
    assert rows.num_warps == 1  # (one-warp programs: the unproven vote needs no barrier)
    assert default_config(3000, 256, torch.bfloat16).chunk == 8 and default_config(9000, 256, torch.float16).chunk == 2
    assert default_config(3000, 128, torch.float32).algorithm == "rows"
    assert default_config(65536, 128, torch.float32).chunk == 2  # (float32 of up to 128 experts: tiles of two chunks)
    from routetool_kernels.routing_policy import rows_loads
    assert rows_loads(128, 4, 2)[0] == 2 and rows_loads(128, 4, 4)[0] == 0 and rows_loads(256, 4, 2)[0] == 1
    assert default_config(16384, 128, torch.float32).chunk == 4  # (own loads)
    assert default_config(3000, 128, torch.float32).chunk == 8
    fp32 = default_config(65536, 256, torch.float32)  # (float32 above 128 experts: coalesced tiles)
    assert fp32.algorithm == "rows" and fp32.chunk == 4 and fp32.num_warps == 1
    assert default_config(16384, 256, torch.float32).chunk == 8
    from routetool_kernels.routing_policy import rows_loads
    # (chunks ahead: 16-bit logits only, where a thread takes >= 8 chunks, the most of 4 that divides them)
    assert rows_loads(256, 4, 4) == (1, 1, 8) and rows_loads(256, 2, 2) == (0, 4, 16) and rows_loads(128, 2, 4)[1] == 1
    assert rows_loads(200, 2, 1) == (0, 1, 25) and rows_loads(80, 2, 1) == (0, 2, 10) and rows_loads(64, 2, 2)[1] == 1
    assert default_config(2048, 256, torch.bfloat16).algorithm == "scan"
    assert default_config(65536, 256, torch.bfloat16, topk=9).algorithm == "two_level"
    assert default_config(65536, 257, torch.bfloat16).algorithm == "two_level"
    assert default_config(65536, 384, torch.float32).chunk == 32
    assert default_config(65536, 512, torch.float32).chunk == 32
    assert default_config(65536, 512, torch.float32, topk=20).chunk == 32
    assert default_config(65536, 512, torch.float32, topk=40).algorithm == "scan"   # topk above the columns
    assert default_config(65536, 8, torch.float32, topk=8, normalization="softmax").chunk == 8
    assert default_config(65536, 256, torch.float32, device_type="cpu").algorithm == "scan"


def test_switches_set_on_the_policy_module_change_the_launch(device, monkeypatch, request):
    # default_config and the launcher read the switches from routetool_kernels.routing_policy on every
    # checked call
    from routetool_kernels import routing_policy

    request.addfinalizer(clear_plans)  # (no plan made under a patched switch outlives the test)
    assert default_config(3000, 256, torch.float32, normalization="softmax").algorithm == "two_level"
    monkeypatch.setattr(routing_policy, "SMALL_BATCH", 4096)
    assert default_config(3000, 256, torch.float32, normalization="softmax").algorithm == "scan"
    assert default_config(8000, 256, torch.float32, normalization="softmax").programs_per_sm == 32
    monkeypatch.setattr(routing_policy, "PERSISTENT_FROM", 10000)
    assert default_config(8000, 256, torch.float32, normalization="softmax").programs_per_sm == 0
    monkeypatch.setattr(routing_policy, "TWO_LEVEL_MAX_TOPK", 4)
    assert default_config(8000, 256, torch.float32, topk=8, normalization="softmax").algorithm == "scan"
    assert default_config(8000, 256, torch.bfloat16).algorithm == "rows"
    monkeypatch.setattr(routing_policy, "ROWS_LAUNCHES", ((0, 2, 2),))
    assert default_config(8000, 256, torch.bfloat16).block_t == 32
    monkeypatch.setattr(routing_policy, "ROWS_MAX_EXPERTS", 128)
    assert default_config(8000, 256, torch.bfloat16).algorithm == "scan"
    # the launcher's check of a config reads the policy module too
    clear_plans()
    x, bias = torch.zeros((2, 64), device=device), torch.zeros(64, device=device)
    fused_musespark1x_routing(x, bias, 4, 1.0)
    clear_plans()
    monkeypatch.setattr(routing_policy, "MAX_TILE_ELEMENTS", 16)
    with pytest.raises(ValueError, match="exceeds Triton's largest tensor"):
        fused_musespark1x_routing(x, bias, 4, 1.0)


def test_the_policy_rounds_up_to_powers_of_two_as_triton_does():
    import triton

    from routetool_kernels.routing_policy import _next_power_of_2

    assert [_next_power_of_2(n) for n in range(1, 2050)] == [triton.next_power_of_2(n) for n in range(1, 2050)]


@pytest.mark.parametrize("bad,message", [
    (dict(algorithm="bitonic"), "algorithm='bitonic'"),
    (dict(algorithm="two_level", chunk=8), "needs topk <= chunk"),
    (dict(algorithm="two_level", programs_per_sm=-1), "programs_per_sm=-1"),
    (dict(max_registers=8), "max_registers=8"),
    (dict(num_warps=64), "num_warps=64 exceeds 32"),
    (dict(block_t=2**15), "exceeds Triton's largest tensor"),
    (dict(chunk=32.0), "chunk=32.0 must be an int"),
    (dict(programs_per_sm=None), "programs_per_sm=None must be an int"),
    (dict(programs_per_sm=1.5), "programs_per_sm=1.5 must be an int"),
    (dict(block_t=0), "block_t=0 must be a power of two"),
    (dict(dynamic_tiles=1), "dynamic_tiles=1 must be a bool"),
    (dict(dynamic_tiles=True), "dynamic_tiles=True needs algorithm='two_level' and programs_per_sm > 0"),
    (dict(algorithm="two_level", dynamic_tiles=True), "dynamic_tiles=True needs"),
    (dict(algorithm="rows", block_t=32), "rows algorithm needs sigmoid scores, topk <= 8"),
])
@pytest.mark.parametrize("num_tokens", [2, 0])
def test_launch_config_errors(bad, message, num_tokens):
    # (an empty batch checks the config too)
    config = LaunchConfig(**{**dict(block_t=1, chunk=32, num_warps=1), **bad})
    with pytest.raises(ValueError, match=message):
        fused_musespark1x_routing(torch.zeros((num_tokens, 64)), torch.zeros(64), 16, 1.0, config=config)
