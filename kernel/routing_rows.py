"""The tiled variant's third algorithm, ``rows``: one thread per token, selection by sorting networks.

Launched by :func:`routetool_kernels.routing.fused_musespark1x_routing` for large sigmoid batches with
``topk <= 8`` and at most 256 experts (:func:`routetool_kernels.routing_policy.default_config`); nothing
here runs on the host. Arithmetic (scores, biased scores, the weights' fixed-point sum) is
:mod:`routetool_kernels.routing_jit`'s, so a token gets the same bits whichever algorithm routes it.

Why: with one warp per token (scan, two-level) every warp instruction handles 32 experts of
one token, and the cross-lane merge, the stores and the loop are paid per token. Here a warp
handles 32 tokens, each thread streaming its own row: no cross-lane work at all, the stores
and the loop paid once per 32 tokens (benchmarks/NOTES.md: 320 SASS instructions per token for
two-level against ~130 here).

**Keys.** Each expert's biased score (``score + bias``, float32) becomes one uint32 *window
key*: the score's bit pattern minus the bit pattern of ``base`` (plus one), times ``2**INDEX_BITS``, plus
``2**INDEX_BITS - 1 - expert``. ``base`` is a power of two chosen per program from the bias: a
biased score is at most ``1 + max(bias)``, and the window ``[base, 2**(32 - INDEX_BITS - 23) *
base)`` (two binades for 256 experts, more for fewer) ends above it. Inside the window the
key's integer order is exactly the order of (biased score descending, expert ascending), the
reference's tie rule, with no rounding: the bit patterns of positive floats are ordered
integers. Scores below the window (and negative ones) are clamped to its bottom, where they
tie; if a pick lands there the token is *unproven*.

**Selection.** A thread keeps its token's best 8 keys sorted (``LANES`` threads may share a token,
each taking every ``LANES``-th chunk, their lists merged at the end: fewer tokens per launch then
still fill the GPU). Per chunk of 8 experts (a loop, each iteration loading the next chunk first): sort
the 8 new keys (Batcher's 19-comparator network, D. E. Knuth, TAOCP vol. 3, 5.3.4), take the
elementwise max of the kept list against the reversed chunk (the upper half of a bitonic
merge; the 8 largest of the 16) and sort that bitonic sequence (12 comparators). A comparator
is a ``max``/``min`` pair of integers.

**Redo.** A program holding an unproven token routes its tile again with exact uint64 keys
(the full order-preserving image of the score above the expert bits), the same network.
"""

from __future__ import annotations

import triton
import triton.language as tl

from routetool_kernels.routing_jit import (
    _LOG2E,
    _TWO_M64,
    _biased_scores,
    _fixed_point,
    _fixed_sum,
    _pick_scales,
    _picked_scores,
    _prepare_bias,
    _prepare_logits,
    _renormalizer,
)

LIST = tl.constexpr(8)  # keys kept per token: topk <= LIST


@triton.jit
def _cx(a, b):
    """A comparator: ``(max, min)``."""
    return tl.maximum(a, b), tl.minimum(a, b)


@triton.jit
def _sort8(k0, k1, k2, k3, k4, k5, k6, k7):
    """Sort 8 keys descending (Batcher's merge-exchange network, 19 comparators)."""
    k0, k2 = _cx(k0, k2)
    k1, k3 = _cx(k1, k3)
    k4, k6 = _cx(k4, k6)
    k5, k7 = _cx(k5, k7)
    k0, k4 = _cx(k0, k4)
    k1, k5 = _cx(k1, k5)
    k2, k6 = _cx(k2, k6)
    k3, k7 = _cx(k3, k7)
    k0, k1 = _cx(k0, k1)
    k2, k3 = _cx(k2, k3)
    k4, k5 = _cx(k4, k5)
    k6, k7 = _cx(k6, k7)
    k2, k4 = _cx(k2, k4)
    k3, k5 = _cx(k3, k5)
    k1, k4 = _cx(k1, k4)
    k3, k6 = _cx(k3, k6)
    k1, k2 = _cx(k1, k2)
    k3, k4 = _cx(k3, k4)
    k5, k6 = _cx(k5, k6)
    return k0, k1, k2, k3, k4, k5, k6, k7


@triton.jit
def _keep_best8(t, s):
    """The 8 largest of two descending 8-key lists ``t`` and ``s`` (tuples), descending: the upper half of a
    bitonic merge (``max(t[i], s[7 - i])`` is bitonic) and a bitonic sort of it (12 comparators)."""
    u0 = tl.maximum(t[0], s[7])
    u1 = tl.maximum(t[1], s[6])
    u2 = tl.maximum(t[2], s[5])
    u3 = tl.maximum(t[3], s[4])
    u4 = tl.maximum(t[4], s[3])
    u5 = tl.maximum(t[5], s[2])
    u6 = tl.maximum(t[6], s[1])
    u7 = tl.maximum(t[7], s[0])
    u0, u4 = _cx(u0, u4)
    u1, u5 = _cx(u1, u5)
    u2, u6 = _cx(u2, u6)
    u3, u7 = _cx(u3, u7)
    u0, u2 = _cx(u0, u2)
    u1, u3 = _cx(u1, u3)
    u4, u6 = _cx(u4, u6)
    u5, u7 = _cx(u5, u7)
    u0, u1 = _cx(u0, u1)
    u2, u3 = _cx(u2, u3)
    u4, u5 = _cx(u4, u5)
    u6, u7 = _cx(u6, u7)
    return u0, u1, u2, u3, u4, u5, u6, u7


@triton.jit
def _columns(x, VEC: tl.constexpr):
    """The ``VEC`` (4 or 8) columns of a ``(BLOCK_T, LANES, VEC)`` tile whose last axis a thread holds, as a
    tuple of ``(BLOCK_T, LANES)`` tensors in column order (splits within a thread: no data moves)."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], VEC // 2, 2]))  # even, odd columns
    if VEC == 4:
        c0, c2 = tl.split(a)
        c1, c3 = tl.split(b)
        cols = (c0, c1, c2, c3)
    else:
        a0, a1 = tl.split(tl.reshape(a, [x.shape[0], x.shape[1], 2, 2]))  # (0, 4), (2, 6)
        b0, b1 = tl.split(tl.reshape(b, [x.shape[0], x.shape[1], 2, 2]))  # (1, 5), (3, 7)
        c0, c4 = tl.split(a0)
        c2, c6 = tl.split(a1)
        c1, c5 = tl.split(b0)
        c3, c7 = tl.split(b1)
        cols = (c0, c1, c2, c3, c4, c5, c6, c7)
    return cols


@triton.jit
def _load_chunk(
    base,  # (BLOCK_T, 1, 1) pointer tile: each row's first expert (logits), or the bias's start in every row
    col,  # (1, 1, VEC) int32: 0 .. VEC - 1
    c,  # (1, LANES, 1) int32: each lane's chunk
    num_experts, stride,
    VEC: tl.constexpr,
    MASK_EXPERTS: tl.constexpr,
):
    """The raw values of experts ``[8c, 8c + 8)`` for every row and lane: two ``(BLOCK_T, LANES, VEC)`` tiles of
    16-byte loads (the second the first again when ``VEC`` is 8); experts past ``num_experts`` read 0."""
    e = c * 8 + col
    if MASK_EXPERTS:
        lo = tl.load(base + e * stride, mask=e < num_experts, other=0.0)
    else:
        lo = tl.load(base + e * stride)
    hi = lo
    if VEC == 4:
        if MASK_EXPERTS:
            hi = tl.load(base + (e + 4) * stride, mask=e + 4 < num_experts, other=0.0)
        else:
            hi = tl.load(base + (e + 4) * stride)
    return lo, hi


@triton.jit
def _chunk_columns(lo, hi, VEC: tl.constexpr):
    """The 8 columns of :func:`_load_chunk`'s tiles, as a tuple of ``(BLOCK_T, LANES)`` tensors."""
    if VEC == 8:
        cols = _columns(lo, 8)
    else:
        cols = _columns(lo, 4) + _columns(hi, 4)
    return cols


@triton.jit
def _window_base(
    bias_ptr,  # (E,) fp32|bf16|fp16, stride stride_bias
    num_experts, stride_bias,
    INDEX_BITS: tl.constexpr,
    E_POW2: tl.constexpr,
    FAST_MATH: tl.constexpr,
):
    """The bit pattern (int32 scalar) of the window's bottom ``base`` less one, and whether the bias holds a NaN.

    The window ``[base, 2**(9 - INDEX_BITS) * base)`` (``base`` at least +0) ends at the power of two above
    ``(1 + max(bias) + 2**-16) * (1 + 2**-20)``: a biased score is at most ``1 + bias`` plus the approximate
    sigmoid's last ulp, so the largest key's value bits stay below ``2**(32 - INDEX_BITS)``.
    """
    e = tl.arange(0, E_POW2)
    b = tl.load(bias_ptr + e * stride_bias, mask=e < num_experts, other=-float("inf")).to(tl.float32)
    nan_bias = tl.max((b != b).to(tl.int32), axis=0) > 0
    top = (1.0 + tl.max(_prepare_bias(b, FAST_MATH), axis=0) + 2.0**-16) * (1.0 + 2.0**-20)
    top = tl.maximum(top, 2.0**-16)  # (every bias <= -1: the window's bottom is +0)
    e_top = (top.to(tl.int32, bitcast=True) >> 23) + 1  # biased exponent of the power of two above
    return (tl.maximum(e_top - (1 << (9 - INDEX_BITS)), 0) << 23) - 1, nan_bias


@triton.jit
def _unguarded_biased_scores(x, bias, FAST_MATH: tl.constexpr):
    """:func:`routetool_kernels.routing_jit._biased_scores` (sigmoid) without its NaN guards on ``x`` and ``bias``:
    the same bits for every non-NaN input, NaN for a NaN one (the caller's row sum catches it)."""
    if FAST_MATH:
        t = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -_LOG2E], dtype=tl.float32,
                                      is_pure=True, pack=1)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [tl.fma(t, _TWO_M64, _TWO_M64)],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.fma(r, _TWO_M64, bias)
    return tl.sigmoid(x) + bias


@triton.jit
def _row_keys(
    xlo, xhi, blo, bhi,  # chunk c's logit and bias tiles (_load_chunk)
    num_experts, router_output_multiplier, base_bits, nan_sum,
    c,  # (1, LANES) int32: each lane's chunk
    VEC: tl.constexpr, BIAS_VEC: tl.constexpr, MASK_EXPERTS: tl.constexpr, INDEX_BITS: tl.constexpr,
    EXACT: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """Keys (``(BLOCK_T, LANES)``) of the 8 experts of each lane's chunk ``c`` for every row, and ``nan_sum``
    plus their biased scores.

    Window keys (uint32) from the unguarded scores, whose NaNs (a NaN logit or bias) make the row sum NaN;
    or with ``EXACT`` uint64 keys (``(order-preserving image of the biased score, as unsigned) << 32`` plus
    the expert bits) from the guarded ones. Experts past ``num_experts`` get key 0, below every real expert.
    """
    xs = _chunk_columns(xlo, xhi, VEC)
    bs = _chunk_columns(blo, bhi, BIAS_VEC)
    MAXIDX: tl.constexpr = (1 << INDEX_BITS) - 1
    e0 = c * 8
    # window key = (max(bits, base_bits) - base_bits) * 2**INDEX_BITS + MAXIDX - expert, as one multiply-add
    # of the clamped bits and a per-expert constant (uint32 arithmetic wraps the constant's sign away)
    off = ((MAXIDX - e0) - base_bits * (1 << INDEX_BITS)).to(tl.uint32, bitcast=True)
    keys = ()
    for j in tl.static_range(8):
        x = _prepare_logits(xs[j], router_output_multiplier, HAS_MULTIPLIER, 0, FAST_MATH)
        if EXACT:
            biased = _biased_scores(x, _prepare_bias(bs[j], FAST_MATH), 0.0, False, 1.0, 0, FAST_MATH)
            bits = biased.to(tl.int32, bitcast=True)
            ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) ^ -(2**31)  # unsigned order = float order
            key = (ordered.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) + (MAXIDX - j - e0).to(tl.uint64)
        else:  # value bits 0: below the window (base_bits is base's pattern less one)
            biased = _unguarded_biased_scores(x, bs[j].to(tl.float32), FAST_MATH)
            nan_sum += biased
            bits = biased.to(tl.int32, bitcast=True)
            key = tl.maximum(bits, base_bits).to(tl.uint32, bitcast=True) * (1 << INDEX_BITS) + (off - j)
        if MASK_EXPERTS:
            key = tl.where(e0 + j < num_experts, key, 0)
        keys = keys + (key,)
    return keys, nan_sum


@triton.jit
def _row_select(
    gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias, router_output_multiplier, base_bits,
    ITERS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BIAS_VEC: tl.constexpr, MASK_EXPERTS: tl.constexpr,
    INDEX_BITS: tl.constexpr, EXACT: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """The best 8 keys of every row, descending (8 ``(BLOCK_T,)`` tensors), and the row sums of the biased
    scores (window keys only; NaN where one is).

    ``LANES`` threads share a row: in iteration ``i`` lane ``l`` takes chunk ``i * LANES + l`` (8 experts), so
    a row's lanes read adjacent 16-byte pieces. A loop of ``ITERS`` iterations, each loading the next chunks
    before it sorts and merges its own (the last re-reads its own, in cache); then the lanes' lists merge
    (a reduction whose step keeps the best 8 of two sorted lists).
    """
    KEY: tl.constexpr = tl.uint64 if EXACT else tl.uint32
    gbase = gating_output_ptr + row_off[:, None, None]
    bbase = bias_ptr + tl.zeros_like(row_off[:, None, None])
    col = tl.arange(0, VEC)[None, None, :]
    bcol = tl.arange(0, BIAS_VEC)[None, None, :]
    lane = tl.arange(0, LANES)[None, :]
    xlo, xhi = _load_chunk(gbase, col, lane[:, :, None], num_experts, stride_gn, VEC, MASK_EXPERTS)
    blo, bhi = _load_chunk(bbase, bcol, lane[:, :, None], num_experts, stride_bias, BIAS_VEC, MASK_EXPERTS)
    nan_sum = tl.zeros([row_off.shape[0], LANES], tl.float32)
    t0 = tl.zeros([row_off.shape[0], LANES], KEY)  # key 0: below every real expert (see _row_keys)
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    t6 = t0
    t7 = t0
    for i in range(ITERS):
        nxt = tl.minimum(i + 1, ITERS - 1) * LANES + lane
        ylo, yhi = _load_chunk(gbase, col, nxt[:, :, None], num_experts, stride_gn, VEC, MASK_EXPERTS)
        clo, chi = _load_chunk(bbase, bcol, nxt[:, :, None], num_experts, stride_bias, BIAS_VEC, MASK_EXPERTS)
        keys, nan_sum = _row_keys(xlo, xhi, blo, bhi, num_experts, router_output_multiplier, base_bits, nan_sum,
                                  i * LANES + lane, VEC, BIAS_VEC, MASK_EXPERTS, INDEX_BITS, EXACT, HAS_MULTIPLIER,
                                  FAST_MATH)
        t0, t1, t2, t3, t4, t5, t6, t7 = _keep_best8((t0, t1, t2, t3, t4, t5, t6, t7), _sort8(*keys))
        xlo = ylo
        xhi = yhi
        blo = clo
        bhi = chi
    best = tl.reduce((t0, t1, t2, t3, t4, t5, t6, t7), 1, _merge_lanes)
    return best, tl.sum(nan_sum, axis=1)


@triton.jit
def _merge_lanes(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """Reduction step of :func:`_row_select`: the best 8 of two lanes' sorted lists."""
    return _keep_best8((a0, a1, a2, a3, a4, a5, a6, a7), (b0, b1, b2, b3, b4, b5, b6, b7))


@triton.jit
def _row_outputs(
    gating_output_ptr, keys, row, row_off, row_ok,
    topk_weights_ptr, topk_ids_ptr, is_padding_ptr,
    stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
    router_output_multiplier, route_scale, division_eps,
    TOPK: tl.constexpr, INDEX_BITS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, HAS_EPS: tl.constexpr,
    FAST_MATH: tl.constexpr, PICK_BITS: tl.constexpr,
):
    """Ids, weights and stores from the sorted keys: the arithmetic of
    :func:`routetool_kernels.routing_jit._write_outputs`, one ``(BLOCK_T,)`` tensor per output slot."""
    MAXIDX: tl.constexpr = (1 << INDEX_BITS) - 1
    ids = ()
    scores = ()
    for k in tl.static_range(TOPK):
        e = (MAXIDX - (keys[k] & MAXIDX)).to(tl.int32)
        ids = ids + (e,)
        scores = scores + (_picked_scores(gating_output_ptr + row_off + e * stride_gn, row_ok,
                                          router_output_multiplier, 0.0, False, 1.0, 0, HAS_MULTIPLIER, FAST_MATH),)
    top_bits = scores[0].to(tl.int32, bitcast=True)
    for k in tl.static_range(1, TOPK):
        top_bits = tl.maximum(top_bits, scores[k].to(tl.int32, bitcast=True))
    scale, unscale = _pick_scales(top_bits, PICK_BITS)
    PICK_LO: tl.constexpr = 2.0**22 if PICK_BITS >= 14 else 2.0**(PICK_BITS + 8)
    hi_sum, lo_sum = _fixed_point(scores[0] * scale, PICK_LO)
    for k in tl.static_range(1, TOPK):
        hi, lo = _fixed_point(scores[k] * scale, PICK_LO)
        hi_sum += hi
        lo_sum += lo
    inv = _renormalizer(_fixed_sum(hi_sum, lo_sum, PICK_LO) * unscale, route_scale, division_eps, HAS_EPS)
    padded = row_ok & False
    if is_padding_ptr is not None:
        padded = tl.load(is_padding_ptr + row * stride_pad, mask=row_ok, other=0) != 0
    for k in tl.static_range(TOPK):
        tl.store(topk_ids_ptr + row * stride_im + k * stride_ik, tl.where(padded, -1, ids[k]), mask=row_ok)
        tl.store(topk_weights_ptr + row * stride_wm + k * stride_wk, tl.where(padded, 0.0, scores[k] * inv),
                 mask=row_ok)


@triton.jit(do_not_specialize=["stride_wk", "stride_ik"])
def _rows_kernel(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    bias_ptr,  # (E,) fp32|bf16|fp16, stride stride_bias
    topk_weights_ptr,  # (T, topk) fp32, strides (stride_wm, stride_wk)
    topk_ids_ptr,  # (T, topk) int32|int64, strides (stride_im, stride_ik); -1 for padded tokens
    is_padding_ptr,  # (T,) bool, stride stride_pad, or None (no padding)
    num_tokens,
    num_experts,
    stride_gm,
    stride_gn,
    stride_bias,
    stride_wm,
    stride_wk,
    stride_im,
    stride_ik,
    stride_pad,
    router_output_multiplier,
    route_scale,
    division_eps,
    TOPK: tl.constexpr,  # <= 8
    BLOCK_T: tl.constexpr,  # tokens per program: 32 * num_warps / LANES
    ITERS: tl.constexpr,  # chunks of 8 experts per lane: cdiv(cdiv(num_experts, 8), LANES)
    LANES: tl.constexpr,  # threads per token (power of two)
    VEC: tl.constexpr,  # logits per 16-byte load: 4 (fp32) or 8
    BIAS_VEC: tl.constexpr,  # bias values per 16-byte load
    MASK_EXPERTS: tl.constexpr,  # num_experts < ITERS * LANES * 8
    INDEX_BITS: tl.constexpr,  # bits of the largest expert index (<= 8)
    E_POW2: tl.constexpr,  # next power of two >= num_experts
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_MATH: tl.constexpr,
    PICK_BITS: tl.constexpr,  # sum of the picked scores: routetool_kernels.routing_policy.sum_bits(topk)
):
    """Rows algorithm (sigmoid scores only). Grid ``(cdiv(num_tokens, BLOCK_T),)``: program ``p`` routes
    tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``, ``LANES`` threads a token (see the module docstring)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < num_tokens
    row_off = tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_gm
    base_bits, nan_bias = _window_base(bias_ptr, num_experts, stride_bias, INDEX_BITS, E_POW2, FAST_MATH)
    keys, nan_sum = _row_select(gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias,
                                router_output_multiplier, base_bits, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                                INDEX_BITS, False, HAS_MULTIPLIER, FAST_MATH)
    # Unproven: a pick clamped to the window's bottom (value bits 0: it may tie with unseen experts there), a NaN
    # logit (its unguarded score is NaN) or a NaN bias anywhere.
    unproven = tl.sum((((keys[TOPK - 1] >> INDEX_BITS) == 0) | (nan_sum != nan_sum)).to(tl.int32)) + nan_bias
    if unproven > 0:
        exact, _ = _row_select(gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias,
                            router_output_multiplier, base_bits, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS, INDEX_BITS,
                            True, HAS_MULTIPLIER, FAST_MATH)
        _row_outputs(gating_output_ptr, exact, row, row_off, row_ok, topk_weights_ptr, topk_ids_ptr,
                     is_padding_ptr, stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
                     router_output_multiplier, route_scale, division_eps, TOPK, INDEX_BITS, HAS_MULTIPLIER, HAS_EPS,
                     FAST_MATH, PICK_BITS)
    else:
        _row_outputs(gating_output_ptr, keys, row, row_off, row_ok, topk_weights_ptr, topk_ids_ptr,
                     is_padding_ptr, stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
                     router_output_multiplier, route_scale, division_eps, TOPK, INDEX_BITS, HAS_MULTIPLIER, HAS_EPS,
                     FAST_MATH, PICK_BITS)
