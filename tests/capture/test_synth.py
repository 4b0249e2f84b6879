"""routetool.capture.synth: determinism, step structure, padding, skew, fitted bias, ties, non-finite rows."""

from pathlib import Path

import pytest
import torch

from routetool_kernels.reference import biased_scores, normalized_scores
from routetool.engine.compare import boundary_margins
from routetool.errors import RouteToolError
from routetool.capture.synth import (
    DEFAULT_TIES,
    GRAPH_BATCH_SIZES,
    SynthSpec,
    synth_stats,
    synth_work,
    synthesize,
    with_default_ties,
)
from routetool.io.trace import RouterConfig, Trace, metadata_dict

ROOT = Path(__file__).resolve().parents[2]


def small(**kw):
    base = dict(num_layers=2, router=RouterConfig(num_experts=40, topk=4, route_scale=1.5), prefill_chunks=(96, 33),
                decode_steps=6, max_decode_batch=20, skew="zipf:1.0", ties=3, nonfinite=2, seed=11, fit_steps=5)
    base.update(kw)
    return SynthSpec(**base)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality that treats NaN as equal to NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _assert_same_trace(x, y):
    (ma, la), (mb, lb) = x, y
    assert metadata_dict(ma, len(la)) == metadata_dict(mb, len(lb))
    assert la.keys() == lb.keys()
    for layer in la:
        for name in ("gating_output", "bias", "is_padding", "step_offsets"):
            assert _same(getattr(la[layer], name), getattr(lb[layer], name)), (layer, name)


def test_deterministic_for_a_seed():
    spec = small(bias="fitted", padding="fraction:0.1", order="interleaved")
    _assert_same_trace(synthesize(spec), synthesize(spec))
    other = synthesize(small(bias="fitted", padding="fraction:0.1", order="interleaved", seed=12))
    assert not torch.equal(other[1][0].gating_output.float().nan_to_num(),
                           synthesize(spec)[1][0].gating_output.float().nan_to_num())


def test_bundled_synthetic_trace_is_reproduced_exactly():
    # the same spec as traces/make_musespark1x_synth.py: the generator has not drifted. The
    # trace was made before the affinity could be lowered for low imbalance targets, so it
    # fixes the affinity at 1.5 (its first two layers' targets, 2.4 and 3.5, are below the
    # unskewed level of that affinity: they got 3.0 and 4.0 on the calibration batch)
    spec = SynthSpec(
        num_layers=4,
        router=RouterConfig(num_experts=256, topk=8, route_scale=2.5, router_score_normalization="sigmoid"),
        dtype=torch.bfloat16, prefill_chunks=(384, 97), decode_steps=24, max_decode_batch=40, skew="imbalance:4",
        bias="fitted", bias_update_rate=1e-3, fit_steps=20, ties=6, nonfinite=0, seed=20261130,
        model="MuseSpark1x-shaped synthetic (256 experts, top-8, sigmoid, bf16)", affinity=1.5,
    )
    meta, layers = synthesize(spec)
    with Trace(ROOT / "traces" / "musespark1x-synth-bf16.safetensors") as t:
        assert t.meta == meta
        for layer in t.layers:
            info = t.info(layer)
            stored = t.read_rows(layer, 0, info.num_tokens)
            assert info.step_offsets == tuple(layers[layer].step_offsets.tolist())
            assert _same(stored.gating_output, layers[layer].gating_output)
            assert _same(stored.is_padding, layers[layer].is_padding)
            assert _same(t.bias(layer), layers[layer].bias)


@pytest.mark.parametrize("order", ["prefill-first", "interleaved"])
def test_steps_graph_padding_and_order(order):
    spec = small(order=order, decode_steps=9, prefill_chunks=(64, 32, 16), nonfinite=0)
    _, layers = synthesize(spec)
    arr = layers[0]
    offsets = arr.step_offsets.tolist()
    sizes = [b - a for a, b in zip(offsets, offsets[1:])]
    pads = [int(arr.is_padding[a:b].sum()) for a, b in zip(offsets, offsets[1:])]
    assert len(sizes) == 3 + 9
    prefill_positions = [i for i, (n, p) in enumerate(zip(sizes, pads)) if n in (64, 32, 16) and p == 0][:3]
    if order == "prefill-first":
        assert sizes[:3] == [64, 32, 16]
    else:  # chunk j before decode step floor(j * 9 / 3): positions 0, 4, 8
        assert [sizes[i] for i in (0, 4, 8)] == [64, 32, 16] and prefill_positions == [0, 4, 8]
    for i, (n, p) in enumerate(zip(sizes, pads)):
        real = n - p
        assert real >= 1
        if n not in (64, 32, 16) or p:  # decode steps: padded up to the next CUDA-graph size
            assert n == next(g for g in GRAPH_BATCH_SIZES if g >= real)
        # padded rows are the last rows of their step
        assert not arr.is_padding[offsets[i]:offsets[i] + real].any()
    # every layer shares the step structure and the padding mask
    assert torch.equal(layers[1].is_padding, arr.is_padding) and torch.equal(layers[1].step_offsets, arr.step_offsets)


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 0.75])
def test_padded_fraction(fraction):
    _, layers = synthesize(small(padding=f"fraction:{fraction}", nonfinite=0, ties=0))
    pad = layers[0].is_padding
    rows = pad.numel()
    # exact up to the rounding of one row
    assert abs(int(pad.sum()) - fraction * rows) <= 1
    offsets = layers[0].step_offsets.tolist()
    assert not pad[: offsets[2]].any()  # prefill chunks are not padded while there are decode steps


def test_no_padding():
    _, layers = synthesize(small(padding="none"))
    assert not layers[0].is_padding.any()


def _imbalances(skew, bias="zero", **kw):
    spec = small(skew=skew, bias=bias, prefill_chunks=(2048,), decode_steps=0, ties=0, nonfinite=0,
                 bias_update_rate=2e-3, fit_steps=30, **kw)
    return synth_stats(*synthesize(spec))


def test_skew_kinds():
    uniform = _imbalances("uniform")
    zipf1 = _imbalances("zipf:1.0")
    zipf2 = _imbalances("zipf:2.0")
    for u, z1, z2 in zip(uniform, zipf1, zipf2):
        assert u.imbalance < 2.0 < z1.imbalance < z2.imbalance  # a larger exponent concentrates more
    # imbalance:X:0 targets X on every layer (bisection on a calibration batch: within 20 %)
    for s in _imbalances("imbalance:3:0"):
        assert 2.4 < s.imbalance < 3.6
    spread = _imbalances("imbalance:3:0.5", num_layers=3)
    assert spread[0].imbalance < spread[2].imbalance  # 1.5 -> 4.5 across layers
    (single,) = _imbalances("imbalance:3", num_layers=1)  # one layer gets X, not X (1 - S) = 1.8
    assert 2.4 < single.imbalance < 3.6


def test_hot_experts_take_the_load():
    spec = small(skew="hot:3:20", prefill_chunks=(2048,), decode_steps=0, ties=0, nonfinite=0)
    meta, layers = synthesize(spec)
    r = meta.router
    scores = normalized_scores(layers[0].gating_output, r.router_score_normalization)
    counts = torch.bincount(biased_scores(scores, layers[0].bias).topk(r.topk, -1).indices.flatten(),
                            minlength=r.num_experts)
    # 3 hot experts of 40 (logit offset ln 20) each take over half the tokens; the mean is 4 * 2048 / 40
    top = counts.sort(descending=True).values
    assert (top[:3] > 0.5 * 2048).all() and top[3] < 0.5 * top[2]


def test_fitted_bias_follows_the_aux_loss_free_rule_and_balances():
    zero = _imbalances("hot:4:8")
    fitted = _imbalances("hot:4:8", bias="fitted")
    for z, f in zip(zero, fitted):
        assert f.imbalance_zero_bias == pytest.approx(z.imbalance_zero_bias, rel=0.3)
        assert f.imbalance < 0.7 * z.imbalance  # the fitted bias evens the load
    spec = small(bias="fitted", bias_update_rate=1e-3, fit_steps=7)
    _, layers = synthesize(spec)
    b = layers[0].bias
    # bias = u * (sum of 7 signs): multiples of u, at most 7u in size
    steps = (b / 1e-3).round()
    assert torch.allclose(b, steps * 1e-3, atol=1e-6) and steps.abs().max() <= 7


def test_ties_and_nonfinite_rows():
    spec = small(ties=5, nonfinite=3, dtype=torch.float32)
    meta, layers = synthesize(spec)
    r = meta.router
    for arr, st in zip(layers.values(), synth_stats(meta, layers)):
        g = arr.gating_output
        bad = (~torch.isfinite(g)).any(-1)
        assert int(bad.sum()) == 3 == st.nonfinite_rows
        assert not (bad & arr.is_padding).any()  # injected on real rows only
        finite = ~bad & ~arr.is_padding
        biased = biased_scores(normalized_scores(g[finite], r.router_score_normalization), arr.bias)
        ties = int((boundary_margins(biased, r.topk, None) == 0).sum())
        assert ties >= 5  # float32 logits: ties come from the injection only
        assert st.boundary_ties >= 5


@pytest.mark.parametrize("kw, message", [
    (dict(skew="zipf"), "not understood"),
    (dict(skew="imbalance:0.5"), "X >= 1"),
    (dict(skew="imbalance:3:1.5"), "0 <= S < 1"),
    (dict(skew="hot:0:2"), "N >= 1"),
    (dict(padding="fraction:1"), r"in \[0, 1\)"),
    (dict(padding="sometimes"), "not understood"),
    (dict(order="random"), "order"),
    (dict(bias="learned"), "zero or fitted"),
    (dict(prefill_chunks=(), decode_steps=0), "no steps"),
    (dict(router=RouterConfig(num_experts=4, topk=5)), "topk=5"),
    # every score sigmoid(0) = 0.5: every row a tie of all experts; synth wrote it and warned about the skew
    (dict(router=RouterConfig(num_experts=16, topk=2, router_output_multiplier=0.0)),
     "router_output_multiplier=0 .--multiplier. makes every logit 0"),
])
def test_bad_specs(kw, message):
    with pytest.raises(RouteToolError, match=message):
        synthesize(small(**kw))


# ---------------------------------------------------------------------------------------
# imbalance targets below the unskewed level, limits, calibration report
def _targets(skew, **kw):
    from routetool.capture.synth import generate

    base = dict(num_layers=2, router=RouterConfig(num_experts=256, topk=8, route_scale=2.5), prefill_chunks=(2048,),
                decode_steps=0, ties=0, nonfinite=0, skew=skew, seed=5)
    base.update(kw)
    result = generate(SynthSpec(**base))
    return result, synth_stats(result.meta, result.layers, result.calibration)


def test_imbalance_targets_below_the_unskewed_level_are_met():
    # at 256 experts, top-8, the affinity 1.5 alone gives max/mean ~3-4: targets below
    # that used to be silently ignored (imbalance:1.5:0 and imbalance:3:0 gave the same trace)
    from routetool.capture.synth import DEFAULT_AFFINITY, synth_warnings

    low, low_stats = _targets("imbalance:1.5:0")
    mid, mid_stats = _targets("imbalance:3:0")
    assert not torch.equal(low.layers[0].gating_output, mid.layers[0].gating_output)
    for st in low_stats:
        assert st.imbalance_target == 1.5 and st.target_reached
        assert st.affinity < DEFAULT_AFFINITY  # lowered to get there
        assert st.calibrated_imbalance == pytest.approx(1.5, rel=0.1)
        assert st.imbalance_zero_bias < 2.0  # the trace's own 2048 tokens, sampling noise aside
    for st in mid_stats:
        assert st.target_reached and st.calibrated_imbalance == pytest.approx(3.0, rel=0.1)
        assert 2.4 < st.imbalance_zero_bias < 3.6
    assert synth_warnings(low_stats) == [] and synth_warnings(mid_stats) == []
    assert "affinity=auto (1.5, lowered to" in low.meta.provenance
    # above the unskewed level the affinity stays 1.5 and nothing changes in the provenance
    high, high_stats = _targets("imbalance:6:0")
    assert all(st.affinity == DEFAULT_AFFINITY and st.target_reached for st in high_stats)
    assert "affinity" not in high.meta.provenance


def test_unreachable_imbalance_targets_are_reported():
    from routetool.capture.synth import synth_warnings

    # below what sampling noise alone gives on the calibration batch
    _, stats = _targets("imbalance:1.05:0")
    assert all(not st.target_reached and st.affinity == 0 and st.calibrated_imbalance > 1.2 for st in stats)
    (line,) = synth_warnings(stats)
    assert line.startswith("layers 0, 1: imbalance target 1.05 is below the lowest level the model can make; got ")
    # a fixed affinity does not move: a target below its level is reported, not met
    _, fixed = _targets("imbalance:1.5:0", affinity=1.5)
    assert all(not st.target_reached and st.affinity == 1.5 for st in fixed)
    assert "below the level of the fixed affinity 1.5" in synth_warnings(fixed)[0]
    assert "--affinity auto" in synth_warnings(fixed)[0]


def test_affinity_zero_leaves_only_sampling_noise():
    _, stats = _targets("uniform", affinity=0.0)
    assert all(st.imbalance_zero_bias < 1.6 for st in stats)  # ~1.4 at 2048 tokens
    _, default = _targets("uniform")
    assert all(st.imbalance_zero_bias > 2.4 for st in default)  # the affinity's own skew


def test_auto_affinity_is_deterministic():
    spec = small(skew="imbalance:1.5:0", num_layers=2)
    _assert_same_trace(synthesize(spec), synthesize(spec))


def test_stats_in_blocks_equal_stats_in_one_piece(monkeypatch):
    import routetool.capture.synth as synth_mod

    meta, layers = synthesize(small(ties=5, nonfinite=3, padding="fraction:0.2"))
    whole = synth_stats(meta, layers)
    monkeypatch.setattr(synth_mod, "STATS_BLOCK_ELEMENTS", 7 * 40)  # 7 rows per block
    assert synth_stats(meta, layers) == whole


def test_progress_adds_up_to_the_work():
    from routetool.capture.synth import generate, synth_work

    spec = small(skew="imbalance:2", bias="fitted")
    done = []
    result = generate(spec, progress=done.append)
    synth_stats(result.meta, result.layers, result.calibration, progress=done.append)
    assert sum(done) == synth_work(spec)


@pytest.mark.parametrize("kw, message", [
    # each case used to run out of memory, overflow, hang or make NaN logits with exit 0
    (dict(padding="fraction:0.999999"), "per layer"),
    (dict(prefill_chunks=(999_999_999_999,)), r"1,000,000,000,005 rows x 40 experts .* the limit is 2\*\*28"),
    (dict(seed=99999999999999999999), r"seed=.* must be in \[0, 2\*\*63-1\]"),
    (dict(seed=-1), r"must be in \[0, 2\*\*63-1\]"),
    (dict(router=RouterConfig(num_experts=100_000, topk=8)), "above the limit 65,536"),
    (dict(router=RouterConfig(num_experts=65536, topk=8), num_layers=4, prefill_chunks=(1,), decode_steps=0,
          skew="imbalance:3"),
     r"logit evaluations .* the limit is 2\*\*34"),
    (dict(decode_steps=100_000_000), "above the limit 1,000,000"),
    (dict(num_layers=2000), r"num_layers=2,000 \(--layers\) must be in \[1, 1,024\]"),
    (dict(num_layers=1000, prefill_chunks=(65536,), decode_steps=0), r"the limit is 2\*\*30"),
    (dict(skew="zipf:nan"), "finite numbers"),
    (dict(skew="imbalance:nan"), "finite numbers"),
    (dict(skew="imbalance:inf"), "finite numbers"),
    (dict(skew="imbalance:3:nan"), "finite numbers"),
    (dict(skew="hot:inf:2"), "finite numbers"),
    (dict(skew="hot:2.5:3"), "integer N"),
    (dict(skew="hot:41:3"), "more than the 40 experts"),
    (dict(skew="zipf:1000"), "A <= 100"),
    (dict(skew="imbalance:11"), "at most experts/topk = 10"),
    (dict(bias_update_rate=float("nan")), "bias_update_rate=nan"),
    (dict(bias_update_rate=2.0), r"must be a finite number in \[0, 1\]"),
    (dict(fit_steps=10**6), "fit_steps"),
    (dict(ties=10**7), "ties and nonfinite"),
    (dict(affinity=float("nan")), "affinity=nan"),
    (dict(affinity=-1.0), "affinity=-1.0"),
    (dict(decode_steps=2.5), "must be integers"),
    # float() read these: underscores, other scripts' digits, spaces
    (dict(skew="zipf:1_0"), r"--skew 'zipf:1_0': '1_0' is not a plain decimal number: .*; write 10.0"),
    (dict(skew="hot:\u0668:4"), "'\u0668' is not a plain decimal number"),
    (dict(skew="imbalance:3: 0.4"), "' 0.4' is not a plain decimal number"),
    (dict(padding="fraction:\u0660.\u0661"), r"--padding 'fraction:\u0660.\u0661': .* write 0.1 \(e.g. fraction:0.1\)"),
])
def test_impossible_specs_fail_before_any_work(kw, message, monkeypatch):
    _refused_before_any_work(kw, message, monkeypatch)


def _refused_before_any_work(kw, message, monkeypatch):
    """``synthesize`` refuses ``small(**kw)`` with ``message`` before drawing anything."""
    import routetool.capture.synth as synth_mod

    def no_work(*a, **k):
        raise AssertionError("the spec must be refused before any logits are drawn")

    monkeypatch.setattr(synth_mod, "_offsets", no_work)
    monkeypatch.setattr(synth_mod, "_draw", no_work)
    with pytest.raises(RouteToolError, match=message):
        synthesize(small(**kw))


@pytest.mark.parametrize("kw, message", [
    # 2 prefill chunks of 5 unpadded rows, 3 taken by ties: 7 left
    (dict(prefill_chunks=(5, 5), decode_steps=0, ties=3, nonfinite=8),
     r"--nonfinite 8: a layer has 10 unpadded rows, 3 of them taken by --ties 3, so only 7 can be made non-finite "
     r"\(pass --nonfinite 7 or fewer, lower --ties, or make more rows"),
    # ties take every row
    (dict(prefill_chunks=(4,), decode_steps=0, ties=4, nonfinite=1),
     r"--nonfinite 1: a layer has 4 unpadded rows, 4 of them taken by --ties 4, so only 0 can be made"),
    # no ties when topk == experts (nothing to tie at the boundary): every unpadded row counts
    (dict(router=RouterConfig(num_experts=4, topk=4), prefill_chunks=(6,), decode_steps=0, ties=0, nonfinite=7,
          skew="uniform"),
     r"--nonfinite 7: a layer has 6 unpadded rows, so only 6 can be made non-finite \(pass --nonfinite 6 or fewer, or"),
    # more tie rows than the layer has (they were made silently fewer), before --nonfinite is looked at
    (dict(prefill_chunks=(4,), decode_steps=0, ties=9, nonfinite=1),
     (r"^--ties 9: a layer has 4 unpadded rows, so only 4 can be given a tie at the k-th boundary \(pass --ties 4 or "
      r"fewer, or make more rows \(--prefill, --decode-steps, --max-decode-batch\)\)$")),
    (dict(prefill_chunks=(1,), decode_steps=0, ties=2, nonfinite=0),
     r"^--ties 2: a layer has 1 unpadded row, so only 1 can be given a tie"),
    # the decode steps' padding rows do not count
    (dict(prefill_chunks=(), decode_steps=3, max_decode_batch=3, ties=100_000, nonfinite=0, seed=1),
     r"^--ties 100,000: a layer has \d unpadded rows, so only \d can be given a tie"),
    # topk == experts: every expert is picked, no k-th boundary to tie at (ties were made silently none)
    (dict(router=RouterConfig(num_experts=4, topk=4), prefill_chunks=(6,), decode_steps=0, ties=3, nonfinite=0,
          skew="uniform"),
     (r"^--ties 3: topk 4 = experts 4, so every expert is picked and no row can be given a tie at the k-th boundary "
      r"\(pass --ties 0, or choose more experts than topk\)$")),
])
def test_more_tie_or_nonfinite_rows_than_the_layer_has_are_refused(kw, message, monkeypatch):
    # they used to be made silently fewer
    _refused_before_any_work(kw, message, monkeypatch)


def test_every_unpadded_row_can_be_a_tie_row():
    spec = small(prefill_chunks=(4,), decode_steps=0, ties=4, nonfinite=0, dtype=torch.float32)
    meta, layers = synthesize(spec)
    for st in synth_stats(meta, layers):
        assert st.boundary_ties == 4  # float32 logits: ties come from the injection only


@pytest.mark.parametrize("kw, ties", [
    (dict(), DEFAULT_TIES),  # room for the default
    (dict(prefill_chunks=(2,), decode_steps=0), 2),  # 2 unpadded rows: 2 ties
    (dict(prefill_chunks=(), decode_steps=1, max_decode_batch=1, padding="fraction:0.5"), 1),  # 1 real row, 1 padded
    (dict(router=RouterConfig(num_experts=4, topk=4), skew="uniform"), 0),  # topk == experts: none
])
def test_the_default_ties_are_lowered_to_what_a_layer_holds(kw, ties):
    spec = with_default_ties(small(ties=DEFAULT_TIES, nonfinite=0, **kw))
    assert spec.ties == ties
    synth_work(spec)  # accepted


def test_as_many_nonfinite_rows_as_are_left_are_made():
    spec = small(prefill_chunks=(5, 5), decode_steps=0, ties=3, nonfinite=7, dtype=torch.float32)
    _, layers = synthesize(spec)
    for arr in layers.values():
        assert int((~torch.isfinite(arr.gating_output)).any(-1).sum()) == 7


@pytest.mark.parametrize("router", [
    # DeepSeek-V3 as configured: 8 groups, the best 4
    RouterConfig(num_experts=64, topk=8, route_scale=2.5, n_group=8, topk_group=4),
    # DeepSeek-V4's scoring; Qwen2-MoE's raw weights; gpt-oss's top-k of the logits
    RouterConfig(num_experts=40, topk=4, route_scale=1.5, router_score_normalization="sqrtsoftplus"),
    RouterConfig(num_experts=40, topk=4, router_score_normalization="softmax", norm_topk_prob=False),
    RouterConfig(num_experts=32, topk=4, router_score_normalization="topk_then_softmax"),
])
def test_every_semantics_is_synthesised_and_routed_by_its_router(router):
    from routetool_kernels.reference import route

    spec = small(router=router, ties=3, nonfinite=0, dtype=torch.float32)
    meta, layers = synthesize(spec)
    assert meta.router == router  # the trace's metadata carries the semantics
    stats = synth_stats(meta, layers)
    for arr, st in zip(layers.values(), stats):
        real = ~arr.is_padding
        _, ids, _, keys = route(arr.gating_output[real], arr.bias, router)
        counts = torch.bincount(ids.long().flatten(), minlength=router.num_experts)
        assert int(counts.sum()) == int(real.sum()) * router.topk
        assert st.imbalance == pytest.approx(float(counts.max() / counts.float().mean()))
        assert st.boundary_ties >= 3  # the tie rows tie at the k-th boundary of the router's own keys
        if router.n_group:  # every token's picks lie in topk_group of the groups
            per = router.num_experts // router.n_group
            assert all(len(set(row)) <= router.topk_group for row in (ids.long() // per).tolist())
