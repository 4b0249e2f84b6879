"""GPU-only checks: compiled kernels at production sizes, CUDA graphs, PDL, the seed's bf16 defect.

Marked ``gpu``: skipped on machines without CUDA. Run on a GPU with ``pytest -m gpu``.
"""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from helpers import assert_routing_invariants
from routetool.engine.compare import RowClass, compare_step, weight_tolerance

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _classes(w, ids, logits, bias, topk, route_scale, pad=None, **kw):
    from routetool_kernels.reference import biased_scores, musespark1x_routing_reference, normalized_scores

    ref_w, ref_ids = musespark1x_routing_reference(logits, bias, topk, route_scale, is_padding=pad, **kw)
    scores = normalized_scores(logits, kw.get("router_score_normalization", "sigmoid"), kw.get("router_output_multiplier"))
    cmp = compare_step(ids, w, ref_ids, ref_w, scores, biased_scores(scores, bias), pad, tie_ulps=16,
                       tolerance=weight_tolerance(torch.float32, route_scale))
    return torch.bincount(cmp.row_class.long(), minlength=len(RowClass)).tolist(), cmp


LARGE = [
    # (num_tokens, num_experts, topk, dtype): production-sized shapes the interpreter cannot afford
    (1, 256, 8, torch.float32),
    (63, 256, 8, torch.bfloat16),
    (4097, 256, 8, torch.bfloat16),
    (65536, 256, 8, torch.float32),
    (3000, 384, 8, torch.bfloat16),
    (1000, 512, 22, torch.float16),
    (777, 60, 4, torch.float32),
    (512, 128, 1, torch.bfloat16),
    (300, 160, 160, torch.float32),
]


@pytest.mark.parametrize("T,E,K,dtype", LARGE)
def test_compiled_kernel_matches_reference(T, E, K, dtype):
    from routetool_kernels import fused_musespark1x_routing

    g = torch.Generator(device="cuda").manual_seed(T + E + K)
    logits = (torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    pad = torch.rand(T, device="cuda", generator=g) < 0.1
    w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad)
    assert_routing_invariants(w, ids, E, K, 2.5, is_padding=pad)
    classes, cmp = _classes(w, ids, logits, bias, K, 2.5, pad)
    assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes
    assert not cmp.weight_over_tol.any()


def _assert_best_first(ids, logits, bias, cmp):
    """Reordered rows (same experts, another order) may differ from the reference only where
    consecutive picks are within 16 float32 ulps (the kernel's exp/rcp are not torch's)."""
    from routetool_kernels.reference import biased_scores, normalized_scores

    rows = (cmp.row_class == RowClass.REORDERED).nonzero().flatten()
    if rows.numel() == 0:
        return
    biased = biased_scores(normalized_scores(logits[rows]), bias)
    picked = biased.gather(1, ids[rows].long())
    tol = 16 * torch.finfo(torch.float32).eps * picked.abs()
    assert (picked[:, :-1] >= picked[:, 1:] - tol[:, 1:]).all(), "a reordered row is not best-first"


TWO_LEVEL = [
    # (num_tokens, num_experts, topk, dtype, block_t, num_warps, columns, programs_per_sm,
    # max_registers, crowd): the persistent grid (several tiles per program, ragged last
    # round; two tiles per loop iteration up to 8 slices per thread, else one), ragged
    # columns, one token per warp in programs of 2 and 4 warps (the redo vote spans the
    # program), register limits, and a bias that crowds picks into one column so that many
    # tiles are redone
    (65536, 256, 8, torch.bfloat16, 1, 1, 32, 28, 0, False),
    (65536, 256, 8, torch.float32, 1, 1, 32, 1, 0, False),
    (65536, 256, 8, torch.float32, 2, 2, 32, 18, 56, False),
    (65536, 256, 8, torch.bfloat16, 4, 4, 32, 10, 48, False),
    (20001, 384, 8, torch.float32, 1, 1, 64, 32, 0, False),
    (20001, 384, 8, torch.float32, 4, 4, 64, 9, 56, True),
    (9000, 512, 16, torch.float16, 2, 1, 32, 3, 0, False),
    (5000, 60, 4, torch.float32, 1, 1, 32, 2, 0, True),
    (4097, 128, 1, torch.bfloat16, 1, 1, 64, 5, 0, False),
    (30000, 256, 8, torch.float32, 1, 1, 32, 28, 0, True),
    (30000, 256, 8, torch.float32, 2, 2, 32, 21, 48, True),
]


@pytest.mark.parametrize("T,E,K,dtype,block_t,num_warps,columns,per_sm,max_registers,crowd", TWO_LEVEL)
def test_two_level_persistent_matches_reference(T, E, K, dtype, block_t, num_warps, columns, per_sm, max_registers,
                                                crowd):
    from routetool_kernels import LaunchConfig, fused_musespark1x_routing

    g = torch.Generator(device="cuda").manual_seed(T + E)
    logits = (torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    if crowd:
        bias[torch.arange(E, device="cuda") % columns == 7] += 0.5
    pad = torch.rand(T, device="cuda", generator=g) < 0.05
    config = LaunchConfig(block_t=block_t, chunk=columns, num_warps=num_warps, algorithm="two_level",
                          programs_per_sm=per_sm, max_registers=max_registers)
    for use_pdl in (True, False):
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad, config=config, use_pdl=use_pdl)
        assert_routing_invariants(w, ids, E, K, 2.5, is_padding=pad)
        classes, cmp = _classes(w, ids, logits, bias, K, 2.5, pad)
        assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes
        _assert_best_first(ids, logits, bias, cmp)
        assert not cmp.weight_over_tol.any()


DYNAMIC = [
    # (num_tokens, num_experts, topk, dtype, programs_per_sm, options): claimed tiles over ragged groups,
    # expert counts off the columns, padding, softmax, multiplier, eps
    (65536, 256, 8, torch.float32, 32, {}),
    (40001, 128, 8, torch.bfloat16, 32, dict(router_score_normalization="softmax")),
    (9000, 200, 6, torch.float16, 4, dict(router_output_multiplier=1.7, router_score_division_eps=1e-3)),
    (5000, 60, 4, torch.float32, 1, {}),
    (4097, 256, 1, torch.float32, 31, {}),  # 4097 tiles over 4092 programs: no pair left to claim
    # more than 256 experts: the one-tile loop, claiming one tile at a time
    (65536, 384, 8, torch.float32, 28, {}),
    (5000, 384, 8, torch.bfloat16, 28, dict(router_score_normalization="softmax")),  # T < 2 P: not all claim
    (12345, 500, 8, torch.float16, 32, dict(router_output_multiplier=1.7, router_score_division_eps=1e-3)),
    (4225, 300, 2, torch.float32, 32, {}),  # 4225 tiles over 4224 programs: one program claims, in vain
]


@pytest.mark.parametrize("T,E,K,dtype,per_sm,options", DYNAMIC)
def test_dynamic_tiles_match_reference_and_leave_counters_zero(T, E, K, dtype, per_sm, options, monkeypatch, request):
    from routetool_kernels import LaunchConfig, fused_musespark1x_routing, routing, routing_policy
    from routetool_kernels._dispatch import clear_plans

    monkeypatch.setattr(routing_policy, "DYNAMIC_TILES_FROM", 1)  # claimed tiles at every size
    clear_plans()  # plans made under the old threshold would keep their static tiles
    request.addfinalizer(clear_plans)  # and those made now their claimed ones
    g = torch.Generator(device="cuda").manual_seed(T + E + K)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    config = LaunchConfig(block_t=1, chunk=32, num_warps=1, algorithm="two_level", programs_per_sm=per_sm,
                          dynamic_tiles=True)
    assert routing_policy.tile_counters(torch.device("cuda")) is not None  # (the launch claims: counters exist)
    for rep in range(3):  # back to back: each launch must find the counters at zero
        logits = (torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype)
        pad = torch.rand(T, device="cuda", generator=g) < 0.05
        w, ids = fused_musespark1x_routing(logits, bias, K, 2.5, is_padding=pad, config=config, **options)
        assert_routing_invariants(w, ids, E, K, 2.5, is_padding=pad, eps=options.get("router_score_division_eps"))
        classes, cmp = _classes(w, ids, logits, bias, K, 2.5, pad, **options)
        assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, (rep, classes)
        assert not cmp.weight_over_tol.any()
        assert not routing_policy.tile_counters(logits.device).any()
    if T > per_sm * torch.cuda.get_device_properties(0).multi_processor_count:  # a persistent grid
        plans = list(routing._PLANS._plans.values())
        assert plans and all(p.per_stream is not None for p in plans)  # the patched threshold made it claim


DIRECT = [
    # (variant, num_tokens, num_experts, topk, gating dtype, options): every kind of launch a plan
    # keeps, so that repeated calls take the direct launch of each: scan at one token (num_tokens
    # specialised to 1) and at 64 with padding, two-level with one program per token, the
    # persistent grid claiming tiles (per-stream counters) with 256 and 384 experts, the static
    # persistent grid, the seed, and the seed with a bias it copies to float32
    ("tiled", 1, 256, 8, torch.float32, {}),
    ("tiled", 64, 256, 8, torch.bfloat16, dict(pad=True)),
    ("tiled", 3000, 256, 8, torch.float32, dict(router_score_normalization="softmax")),
    ("tiled", 65536, 256, 8, torch.bfloat16, dict(pad=True)),
    ("tiled", 40000, 384, 8, torch.float32, dict(router_output_multiplier=1.3, router_score_division_eps=1e-3)),
    ("tiled", 20000, 256, 8, torch.float16, dict(static=True)),
    ("seed", 64, 256, 8, torch.float32, dict(pad=True)),
    ("seed", 100, 128, 4, torch.float32, dict(bf16_bias=True)),
]


@pytest.mark.parametrize("variant,T,E,K,dtype,options", DIRECT)
def test_repeated_calls_launch_the_compiled_kernel_directly(variant, T, E, K, dtype, options, monkeypatch):
    import triton.runtime.jit

    import routetool_kernels
    from routetool_kernels import LaunchConfig, routing, seed

    fn = routetool_kernels.variant(variant)
    kw = {k: v for k, v in options.items() if k.startswith("router_")}
    g = torch.Generator(device="cuda").manual_seed(T + E)
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    if options.get("bf16_bias"):
        bias = bias.bfloat16()
    if options.get("static"):
        kw["config"] = LaunchConfig(block_t=1, chunk=32, num_warps=1, algorithm="two_level", programs_per_sm=8)
    logits = torch.empty((T, E), device="cuda", dtype=dtype)
    pad = torch.zeros(T, dtype=torch.bool, device="cuda") if options.get("pad") else None
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    fn(logits.normal_(generator=g), bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad, **kw)  # compiles

    def no_dispatch(*args, **kwargs):
        raise AssertionError("a call of a known signature went through the JIT's dispatch")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", no_dispatch)
    for rep in range(3):
        logits.normal_(generator=g).mul_(2)
        if pad is not None:
            pad.copy_(torch.rand(T, device="cuda", generator=g) < 0.1)
        ids.fill_(-7)
        out_w, out_ids = fn(logits, bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad, **kw)
        assert out_w.data_ptr() == w.data_ptr() and out_ids.data_ptr() == ids.data_ptr()
        ref_kw = {k: v for k, v in kw.items() if k != "config"}
        assert_routing_invariants(w, ids, E, K, 2.5, is_padding=pad, eps=kw.get("router_score_division_eps"))
        classes, cmp = _classes(w, ids, logits, bias.float(), K, 2.5, pad, **ref_kw)
        assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, (rep, classes)
        assert not cmp.weight_over_tol.any()
    plans = (routing if variant == "tiled" else seed)._PLANS
    assert all(p.launch.can_direct for p in plans._plans.values() if p.launch is not None)


@pytest.mark.parametrize("T,dtype", [(64, torch.bfloat16), (5000, torch.float32), (65536, torch.bfloat16)])
def test_an_offset_view_after_an_aligned_one_gets_its_own_kernel(T, dtype):
    # Triton specialises a pointer on its 16-byte alignment (vector loads): the plan of an aligned
    # call must not serve a view one element off (a misaligned vector load would fault).
    from routetool_kernels import fused_musespark1x_routing

    E, K = 256, 8
    flat = torch.randn(T * E + 8, device="cuda").mul_(2).to(dtype)
    bias = torch.randn(E, device="cuda") * 0.05
    for x in (flat[:T * E].view(T, E), flat[1:1 + T * E].view(T, E), flat[:T * E].view(T, E)):
        w, ids = fused_musespark1x_routing(x, bias, K, 2.5)
        torch.cuda.synchronize()
        classes, _ = _classes(w, ids, x, bias, K, 2.5)
        assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes


def test_a_new_stream_gets_its_tile_counters_then_direct_launches():
    from routetool_kernels import fused_musespark1x_routing, routing_policy

    T, E, K = 65536, 256, 8
    config = routing_policy.two_level_config(T, E, K)  # (sigmoid at 256 experts: the rows algorithm by default)
    assert config.dynamic_tiles
    x = torch.randn((T, E), device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, config=config)  # the plan, on this stream
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for rep in range(3):  # the first call finds no counters for the stream and makes them
            x.normal_().mul_(2)
            ids.fill_(-7)
            fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, config=config)
            classes, _ = _classes(w, ids, x, bias, K, 2.5)
            assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, (rep, classes)
    torch.cuda.synchronize()
    assert (stream.device.index, stream.cuda_stream) in routing_policy._TILE_COUNTERS
    assert not any(c.any() for c in routing_policy._TILE_COUNTERS.values())


def test_dynamic_tiles_in_cuda_graph_replays():
    from routetool_kernels import fused_musespark1x_routing, routing_policy

    E, K = 256, 8
    sizes = (65536, 50000, 65536)
    configs = [routing_policy.two_level_config(T, E, K) for T in sizes]  # (not the rows algorithm, the default)
    assert all(c.dynamic_tiles for c in configs)
    bias = torch.randn(E, device="cuda") * 0.05
    xs = [torch.randn((T, E), device="cuda") * 2 for T in sizes]
    outs = [(torch.empty((T, K), device="cuda"), torch.empty((T, K), dtype=torch.int32, device="cuda")) for T in sizes]
    for x, (w, ids), c in zip(xs, outs, configs):  # (eager first: the stream's counters exist before the capture)
        fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, config=c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, (w, ids), c in zip(xs, outs, configs):
            fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, config=c)
    for rep in range(3):
        for x, (w, ids) in zip(xs, outs):
            x.normal_().mul_(2)
            ids.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        for x, (w, ids) in zip(xs, outs):
            classes, cmp = _classes(w, ids, x, bias, K, 2.5)
            assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, (rep, classes)
    capture = torch.cuda.graph.default_capture_stream
    assert (capture.device.index, capture.cuda_stream) in routing_policy._TILE_COUNTERS  # the graph claimed its tiles
    assert not any(c.any() for c in routing_policy._TILE_COUNTERS.values())


def test_dynamic_tiles_without_counters_during_capture_fall_back_to_static():
    from routetool_kernels import fused_musespark1x_routing, routing_policy

    T, E, K = 65536, 256, 8
    config = routing_policy.two_level_config(T, E, K)  # (not the rows algorithm, the default)
    x = torch.randn((T, E), device="cuda")
    bias = torch.zeros(E, device="cuda")
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # a fresh stream: no counters, and none may be allocated now
        fused_musespark1x_routing(x, bias, K, 2.5, topk_weights=w, topk_ids=ids, config=config)
    assert (stream.device.index, stream.cuda_stream) not in routing_policy._TILE_COUNTERS
    graph.replay()
    torch.cuda.synchronize()
    classes, _ = _classes(w, ids, x, bias, K, 2.5)
    assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes


def test_two_level_cuda_graph_sees_new_padding_and_bias():
    from routetool_kernels import fused_musespark1x_routing
    from routetool_kernels.routing_policy import two_level_config

    T, E, K = 40000, 256, 8
    config = two_level_config(T, E, K)  # (not the rows algorithm, the default at 256 experts)
    logits = torch.randn((T, E), device="cuda")
    bias = torch.zeros(E, device="cuda")
    pad = torch.zeros(T, dtype=torch.bool, device="cuda")
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    fused_musespark1x_routing(logits, bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad, config=config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_musespark1x_routing(logits, bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad, config=config)
    pad[::3] = True
    bias[17] = 10.0
    graph.replay()
    torch.cuda.synchronize()
    assert (ids[~pad][:, 0] == 17).all()
    classes, cmp = _classes(w, ids, logits, bias, K, 2.5, pad)
    assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0
    _assert_best_first(ids, logits, bias, cmp)
    assert classes[RowClass.PADDED] == int(pad.sum())
    assert not cmp.weight_over_tol.any()


@pytest.mark.parametrize("variant", ["tiled", "seed"])
def test_cuda_graph_sees_new_padding_and_bias(variant):
    import routetool_kernels
    from routetool_kernels.reference import musespark1x_routing_reference

    fn = routetool_kernels.variant(variant)
    T, E, K = 48, 256, 8
    logits = torch.randn((T, E), device="cuda")
    bias = torch.zeros(E, device="cuda")
    pad = torch.zeros(T, dtype=torch.bool, device="cuda")
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    fn(logits, bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(logits, bias, K, 2.5, topk_weights=w, topk_ids=ids, is_padding=pad)
    graph.replay()
    torch.cuda.synchronize()
    before = ids.clone()
    pad[::3] = True
    bias[before[1, -1]] = 10.0  # force expert into every row
    graph.replay()
    torch.cuda.synchronize()
    ref_w, ref_ids = musespark1x_routing_reference(logits, bias, K, 2.5, is_padding=pad)
    assert not torch.equal(before, ids)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-6)


def _switch_batches(E, K, dtype):
    """Batch sizes on either side of each switch of the policy on this GPU: the scan/two-level (or rows)
    switch, the per-SM grid, the persistent grid (more tiles than programs), the claimed tiles and the rows
    algorithm's threads a token."""
    from routetool_kernels import routing_policy as policy

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_sm = policy.default_config(policy.PERSISTENT_FROM + 1, E, dtype, "cuda", K).programs_per_sm or 32
    grid = per_sm * sms
    dynamic = policy.DYNAMIC_TILES_FROM * grid
    rows = {n for above in policy.rows_switches() for n in (above, above + 1)}
    return sorted({1, 7, policy.SMALL_BATCH, policy.SMALL_BATCH + 1, policy.PERSISTENT_FROM,
                   policy.PERSISTENT_FROM + 1, grid, grid + 1, dynamic - 1, dynamic, 65536} | rows)


BATCH_INVARIANCE = [
    # (E, K, normalization, dtype, padding and bias): the models family's expert counts, every dtype (not
    # 512 x 22: compiling its two-level kernels takes minutes; validate's models family routes it)
    (256, 8, "sigmoid", torch.float32, True), (256, 8, "sigmoid", torch.bfloat16, True),
    (256, 8, "sigmoid", torch.float16, False), (384, 8, "sigmoid", torch.float32, True),
    (512, 10, "softmax", torch.bfloat16, False), (512, 8, "sigmoid", torch.float32, True),
    (160, 6, "softmax", torch.float16, True), (128, 8, "sigmoid", torch.bfloat16, True),
    (64, 6, "softmax", torch.float32, False), (60, 4, "softmax", torch.bfloat16, True),
    (8, 2, "softmax", torch.float16, True), (256, 16, "sigmoid", torch.float32, False),
    (128, 8, "sigmoid", torch.float32, True),  # (float32 of up to 128 experts: tiles of two chunks above 32768)
]


@pytest.mark.parametrize("E,K,norm,dtype,extras", BATCH_INVARIANCE)
def test_a_token_gets_the_same_bits_in_batches_across_every_switch(E, K, norm, dtype, extras):
    # 7 probe tokens (and one padded row) placed at the start, middle and end of batches straddling each
    # switch of the launch policy on this GPU, against each token routed alone: ids and weight bits equal
    from routetool_kernels import fused_musespark1x_routing

    g = torch.Generator(device="cuda").manual_seed(E + K)
    probes = (torch.randn((7, E), device="cuda", generator=g) * 2).to(dtype)
    bias = torch.randn(E, device="cuda", generator=g) * 0.1 if extras else torch.zeros(E, device="cuda")
    kw = dict(router_score_normalization=norm)
    if extras:
        kw.update(router_output_multiplier=1.3, router_score_division_eps=1e-20)
    alone = [fused_musespark1x_routing(probes[i:i + 1].clone(), bias, K, 2.5, **kw) for i in range(7)]
    for n in _switch_batches(E, K, dtype):
        batch = (torch.randn((n, E), device="cuda", generator=g) * 2).to(dtype)
        rows = sorted({0, n // 3, n // 2, n - 1} | ({n - 2, n - 3, n - 4} if n >= 7 else set()))[:7]
        rows = rows + [r for r in range(n) if r not in rows][:7 - len(rows)]
        batch[rows] = probes[:len(rows)]
        pad = torch.zeros(n, dtype=torch.bool, device="cuda")
        if extras and n > 7:
            pad[[r for r in range(n) if r not in rows][0]] = True
        w, ids = fused_musespark1x_routing(batch, bias, K, 2.5, is_padding=pad if extras else None, **kw)
        for i, r in enumerate(rows):
            assert torch.equal(ids[r], alone[i][1][0]), (n, r)
            assert torch.equal(w[r].view(torch.int32), alone[i][0][0].view(torch.int32)), (n, r, w[r] - alone[i][0][0])


@pytest.mark.parametrize("variant", ["tiled", "seed"])
def test_pdl_on_and_off_agree(variant):
    import routetool_kernels

    fn = routetool_kernels.variant(variant)
    logits = torch.randn((1000, 256), device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    a = fn(logits, bias, 8, 2.5, use_pdl=True)
    b = fn(logits, bias, 8, 2.5, use_pdl=False)
    assert torch.equal(a[1], b[1]) and torch.equal(a[0], b[0])


def test_seed_kernel_fails_to_compile_for_bf16():
    """The documented seed defect: tl.sigmoid on bf16 does not compile (why the launcher rejects it)."""
    import triton

    from routetool_kernels.seed import _seed_routing_kernel

    T, E, K = 4, 256, 8
    logits = torch.randn((T, E), device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(E, device="cuda")
    w = torch.empty((T, K), device="cuda")
    ids = torch.empty((T, K), dtype=torch.int32, device="cuda")
    with pytest.raises((triton.CompilationError, RuntimeError, ValueError, TypeError)):
        _seed_routing_kernel[(T,)](
            logits, bias, w, ids, None, 0, T, E, logits.stride(0), logits.stride(1), w.stride(0), w.stride(1),
            ids.stride(0), ids.stride(1), 1.0, 2.5, 0.0, TOPK=K, TOPK_PADDED=8, NUM_EXPERTS_PADDED=256,
            NORMALIZATION_MODE=0, HAS_MULTIPLIER=False, HAS_EPS=False, USE_PDL=False, num_warps=1,
        )
        torch.cuda.synchronize()


@pytest.mark.parametrize("trace", sorted((ROOT / "traces").glob("*.safetensors")), ids=lambda p: p.name)
def test_replay_with_latency(trace, tmp_path):
    from routetool.cli import main

    out = tmp_path / "r.json"
    res = CliRunner().invoke(main, ["replay", str(trace), "--device", "cuda", "--json", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["latency"]["measured"] is True
    for shape in doc["latency"]["shapes"]:
        assert 0 < shape["kernel_latency_us"]["p10"] <= shape["kernel_latency_us"]["p50"] <= shape["kernel_latency_us"]["p90"]
        assert shape["reference_latency_us"]["p50"] > 0


@pytest.mark.parametrize("E,K,dtype", [(256, 8, torch.bfloat16), (256, 8, torch.float32), (60, 4, torch.float16),
                                       (130, 6, torch.bfloat16)])
@pytest.mark.parametrize("num_warps,lanes", [(1, 1), (4, 1), (8, 1), (1, 2), (4, 2), (1, 4), (4, 4), (4, 8)])
def test_rows_matches_the_scan_bit_for_bit(E, K, dtype, num_warps, lanes):
    # The rows algorithm (one thread per token, window keys, an exact redo) against the scan algorithm on the
    # same large batch: the same ids and weight bits for every token, and the reference's picks. Rows of ties,
    # NaN logits and scores below the window send their tiles to the redo.
    _rows_against_scan(E, K, dtype, num_warps, lanes)


@pytest.mark.parametrize("E,K,dtype", [(256, 8, torch.bfloat16), (130, 6, torch.bfloat16), (256, 8, torch.float32),
                                       (100, 8, torch.float32)])
@pytest.mark.parametrize("ahead,tile", [(4, 0), (2, 0), (1, 0), (1, 2), (1, 4)])
def test_rows_launch_switches_change_no_bit_compiled(E, K, dtype, ahead, tile, monkeypatch, request):
    # The rows kernel's switches as a sweep turns them, compiled: chunks loaded ahead (130 experts: 9 or 5
    # iterations a thread, so one ahead whatever is asked) and coalesced tiles (bf16 read as words of two; float32
    # at 256 experts always takes tiles of one chunk a thread, at 100 experts tiles of two chunks at two threads a
    # token, the last tile partly past the row); two and four threads a token
    from routetool_kernels import routing_policy
    from routetool_kernels._dispatch import clear_plans

    request.addfinalizer(clear_plans)
    monkeypatch.setattr(routing_policy, "ROWS_AHEAD", ahead)
    monkeypatch.setattr(routing_policy, "ROWS_AHEAD_FROM", 1)
    monkeypatch.setattr(routing_policy, "ROWS_TILE", tile)
    clear_plans()
    for lanes in (2, 4):
        _rows_against_scan(E, K, dtype, 1, lanes)


@pytest.mark.parametrize("E", [256, 128])
@pytest.mark.parametrize("num_warps,lanes", [(1, 2), (1, 4), (2, 2), (1, 1)])
def test_rows_tma_tiles_match_the_scan_bit_for_bit(E, num_warps, lanes, monkeypatch, request):
    # The rows kernel with its tiles copied by the tensor-memory accelerator (ROWS_TMA_FROM lowered to take the
    # 8197-token batch), compiled: the scan's ids and weight bits and the reference's picks, as with the threads'
    # own loads
    from routetool_kernels import routing, routing_policy
    from routetool_kernels._dispatch import clear_plans

    request.addfinalizer(clear_plans)
    monkeypatch.setattr(routing_policy, "ROWS_TMA_FROM", 1024)
    clear_plans()
    probe = torch.empty((8197, E), dtype=torch.bfloat16, device="cuda")
    assert routing._row_tma(probe, torch.empty(E, device="cuda"), 8197, lanes)
    for _ in range(2):  # (the second from the first's plans: direct launches, each call's own descriptors)
        _rows_against_scan(E, 8, torch.bfloat16, num_warps, lanes)


@pytest.mark.parametrize("E,tma_from", [(256, 1024), (128, 1024), (256, 0)])
def test_rows_redo_through_own_loads_matches_the_scan_bit_for_bit(E, tma_from, monkeypatch, request):
    # ROWS_REDO_OWN_LOADS: the exact redo through each thread's own pieces, one chunk at a time (the TMA launch and
    # the threads' own loads, two threads a token), compiled: the scan's ids and weight bits on 8197 tokens whose
    # NaN row and row below the window send their tiles to the redo
    from routetool_kernels import routing_policy
    from routetool_kernels._dispatch import clear_plans

    request.addfinalizer(clear_plans)
    monkeypatch.setattr(routing_policy, "ROWS_TMA_FROM", tma_from)
    monkeypatch.setattr(routing_policy, "ROWS_REDO_OWN_LOADS", 1)
    clear_plans()
    _rows_against_scan(E, 8, torch.bfloat16, 1, 2)


def _rows_against_scan(E, K, dtype, num_warps, lanes):
    from routetool_kernels import LaunchConfig, default_config, fused_musespark1x_routing

    T = 8197
    g = torch.Generator(device="cuda").manual_seed(E * num_warps + K + lanes)
    x = (torch.randn((T, E), device="cuda", generator=g) * 2).to(dtype)
    x[5] = 0
    x[77] = x[77].round()
    x[300, :3] = float("nan")
    x[4000] = -40.0
    bias = torch.randn(E, device="cuda", generator=g) * 0.05
    pad = torch.rand(T, device="cuda", generator=g) < 0.1
    rows = LaunchConfig(block_t=32 * num_warps // lanes, chunk=lanes, num_warps=num_warps, algorithm="rows")
    scan = default_config(1, E, dtype)  # the decode launch: one token per program
    w, ids = fused_musespark1x_routing(x, bias, K, 2.5, is_padding=pad, config=rows)
    ws, ids_s = fused_musespark1x_routing(x, bias, K, 2.5, is_padding=pad, config=scan)
    assert torch.equal(ids, ids_s)
    assert torch.equal(w.view(torch.int32), ws.view(torch.int32))
    classes, _ = _classes(w, ids, x, bias, K, 2.5, pad)
    assert classes[RowClass.MISMATCH] == 0 and classes[RowClass.INVALID] == 0, classes
    # rows one element apart and off a 4-byte boundary: no L2 prefetch, bf16 logits read one by one
    view = torch.empty((T, E + 1), device="cuda", dtype=dtype)[:, 1:]
    view.copy_(x)
    wv, ids_v = fused_musespark1x_routing(view, bias, K, 2.5, is_padding=pad, config=rows)
    assert torch.equal(ids_v, ids_s) and torch.equal(wv.view(torch.int32), ws.view(torch.int32))
