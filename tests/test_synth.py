"""routetool.synth: determinism, step structure, padding, skew, fitted bias, ties, non-finite rows."""

from pathlib import Path

import pytest
import torch

from kernel.reference import biased_scores, normalized_scores
from routetool.compare import boundary_margins
from routetool.errors import RouteToolError
from routetool.synth import GRAPH_BATCH_SIZES, SynthSpec, synth_stats, synthesize
from routetool.trace import RouterConfig, Trace, metadata_dict

ROOT = Path(__file__).resolve().parents[1]


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
    # the same spec as traces/make_musespark1x_synth.py: the generator has not drifted
    spec = SynthSpec(
        num_layers=4,
        router=RouterConfig(num_experts=256, topk=8, route_scale=2.5, router_score_normalization="sigmoid"),
        dtype=torch.bfloat16, prefill_chunks=(384, 97), decode_steps=24, max_decode_batch=40, skew="imbalance:4",
        bias="fitted", bias_update_rate=1e-3, fit_steps=20, ties=6, nonfinite=0, seed=20261130,
        model="MuseSpark1x-shaped synthetic (256 experts, top-8, sigmoid, bf16)",
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
])
def test_bad_specs(kw, message):
    with pytest.raises(RouteToolError, match=message):
        synthesize(small(**kw))
