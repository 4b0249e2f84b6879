"""The tiled variant's ``@triton.jit`` code: :func:`_routing_kernel` (scan), :func:`_two_level_kernel` and
:func:`_rows_kernel`.

Launched by :func:`routetool_kernels.routing.fused_musespark1x_routing` with the launch settings of
:mod:`routetool_kernels.routing_policy`; nothing here runs on the host.

Shared by both algorithms:

* Logits of any float dtype are upcast to float32 and multiplied by the optional
  ``router_output_multiplier``.
* Scores: sigmoid, or stable softmax (NaN logits count as -inf). On NVIDIA GPUs the
  sigmoid uses the approximate ``ex2``/``rcp`` instructions (:func:`_sigmoid`, within a
  few float32 ulps of ``torch.sigmoid``); under the interpreter it is ``tl.sigmoid``.
* One int32 key per expert: the order-preserving integer image of the float32 biased score
  (``score + bias``; a NaN bias counts as -inf). The largest key wins; of equal keys the
  lowest expert index wins, exactly as ``tl.argmax`` breaks ties.
* Weights: the picked experts' logits are re-read (in cache) and only those ``topk`` scores
  are recomputed, renormalised by ``route_scale / (sum + eps)``; a zero denominator gives
  weights 0. Padded rows get id -1 and weight 0. Programmatic dependent launch on Hopper.
* One arithmetic for every algorithm and tile (batch invariance): the sum of the picked
  scores and the softmax total are taken in fixed point (:func:`_fixed_point`), exact in any
  order, and rounded to float32 once; products that a compiler could fuse with a following
  add are explicit (:func:`_biased_scores`, :func:`_mul_rn`). So a token's ids and weights
  are the same bits whichever algorithm, tile or grid routes it (docs/kernel.md).

**Scan** (:func:`_routing_kernel`; decode batches): a ``[BLOCK_T, NUM_CHUNKS, CHUNK]`` tile
of logits (``CHUNK / vector width`` lanes share a row; 32 by default, so that every
reduction is one warp-wide ``REDUX`` on Hopper) and ``topk`` rounds of (largest key, lowest
expert holding it, mask it out). Each round scans every expert of the row.

**Two-level** (:func:`_two_level_kernel`; prefill batches): one warp per token, expert ``e``
in column ``e % WIDTH`` of slice ``e // WIDTH``. Level 1 streams the slices once, keeping per
column its best two (score, expert) in order and its third-best score. Level 2 merges the
columns' pairs with ``topk`` rounds of one warp-wide max over the column heads. That is the
exact top-k unless a column holds three of the picks (the third-best scores detect it) or
two heads hold equal keys (more pops than ``topk``); such tiles are redone by repeated
argmax over the logits still in registers. Each expert is touched a constant number of
times instead of ``topk`` times; a persistent grid loads each token's logits one token
ahead and, with many tokens per program, claims tokens from self-resetting atomic counters
(:func:`routetool_kernels.routing_policy.tile_counters`) so that all programs end together.
Measurements: benchmarks/NOTES.md.

**Rows** (:func:`_rows_kernel`; prefill batches of sigmoid routers with ``topk <= 8`` and at most
256 experts): one thread per token (or ``LANES`` threads sharing a token), so a warp routes 32
tokens and nothing crosses lanes: the cross-lane merge, the stores and the loop that scan and
two-level pay per token are paid once per 32 (SASS for sm_90: ~163 instructions a token against
two-level's 320).

* *Keys.* Each expert's biased score becomes one uint32 *window key*: the score's bit pattern
  minus the bit pattern of ``base`` (plus one), times ``2**INDEX_BITS``, plus ``2**INDEX_BITS - 1 -
  expert``. ``base`` is a power of two chosen per program from the bias: a biased score is at most
  ``1 + max(bias)``, and the window ``[base, 2**(32 - INDEX_BITS - 23) * base)`` (two binades for
  256 experts, more for fewer) ends above it. Inside the window the keys' integer order is exactly
  (biased score descending, expert ascending), the reference's rule, with no rounding: the bit
  patterns of positive floats are ordered integers. Scores below the window (and negative ones)
  are clamped to its bottom, where they tie; a pick there leaves the token *unproven*. The clamp is
  an integer ``max`` and the rest one IMAD (FMA pipe; the ALU pipe is the loop's busiest); bf16
  logits are read as int32 words of two, each made float32 by one shift or mask.
* *Selection.* A thread keeps its token's best 8 keys sorted (``LANES`` threads sharing a token
  take every ``LANES``-th chunk and merge their lists at the end, so that fewer tokens still fill
  the GPU). Per chunk of 8 experts (a loop, each iteration loading a chunk ``AHEAD`` iterations
  ahead, or, for float32 logits, a program's coalesced tile of ``LANES * TILE * 32`` bytes a row
  through shared memory: one chunk a thread for more than 128 experts, two at two threads a token
  for up to 128): sort the
  8 new keys (Batcher's 19-comparator network, D. E. Knuth, TAOCP vol. 3, 5.3.4), take the
  elementwise max of the kept list against the reversed chunk (the upper half of a bitonic merge:
  the 8 largest of the 16) and sort that bitonic sequence (12 comparators). A comparator is an
  integer ``max`` and ``min``.
* *Redo.* A program holding an unproven token, a NaN logit (its unguarded score is NaN and so is
  the row's sum) or a NaN bias routes its tile again with exact uint64 keys (the full
  order-preserving image of the score above the expert bits), through the same network.

Shapes in the argument comments: ``T`` tokens, ``E`` experts, ``topk`` picks per token.
"""

from __future__ import annotations

import triton
import triton.language as tl

_EMPTY_KEY = tl.constexpr(-(2**31))  # below every real key: the image of -inf is -2**31 + 0x7FFFFF


_UNROLL_MAX_TOPK = tl.constexpr(32)
_LOG2E = tl.constexpr(1.4426950408889634)
_TWO_M64 = tl.constexpr(2.0**-64)
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + _ROUNDER holds round(x) in its low bits for |x| < 2**22
_ROUNDER_BITS = tl.constexpr(0x4B400000)  # its bit pattern


@triton.jit
def _mul_rn(x, y, FAST_MATH: tl.constexpr):
    """``x * y`` rounded on its own: on NVIDIA GPUs (``FAST_MATH``) a ``mul.rn.f32``, which neither LLVM nor ptxas
    fuses into a following add, so the product has the same bits wherever it is used."""
    if FAST_MATH:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [x, y], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return x * y


@triton.jit
def _prepare_logits(x, router_output_multiplier, HAS_MULTIPLIER: tl.constexpr, NORMALIZATION_MODE: tl.constexpr,
                    FAST_MATH: tl.constexpr):
    """float32 logits times the optional multiplier; under softmax NaN -> -inf (:func:`_sigmoid` takes NaN itself)."""
    x = x.to(tl.float32)
    if HAS_MULTIPLIER:
        x = _mul_rn(x, router_output_multiplier, FAST_MATH)
    if NORMALIZATION_MODE == 1:
        x = tl.where(x != x, -float("inf"), x)
    return x


@triton.jit
def _fixed_point(x, LO_SCALE: tl.constexpr):
    """Split float32 ``x`` (``0 <= x <= 2**22``) into int32 ``(hi, lo)``: ``hi = round(x)``, ``lo = round((x - hi) *
    LO_SCALE)`` (``LO_SCALE`` a power of two <= ``2**22``), so ``x = hi + lo / LO_SCALE`` to ``0.5 / LO_SCALE``.

    Integer sums of the parts are exact and so the same in any order: the order-independent float sum of
    :func:`_fixed_sum`. Each rounding adds ``1.5 * 2**23`` and reads the low bits (round to nearest even);
    every step is exact or rounds once, so a fused multiply-add gives the same bits.
    """
    y = x + _ROUNDER
    hi = y.to(tl.int32, bitcast=True) - _ROUNDER_BITS
    r = x - (y - _ROUNDER)  # exact: |r| <= 0.5, a multiple of x's ulp
    lo = (r * LO_SCALE + _ROUNDER).to(tl.int32, bitcast=True) - _ROUNDER_BITS
    return hi, lo


@triton.jit
def _fixed_sum(hi_sum, lo_sum, LO_SCALE: tl.constexpr):
    """float32 ``hi_sum + lo_sum / LO_SCALE`` of summed :func:`_fixed_point` parts (``|hi_sum| <= 2**24``: exact
    in float32), rounded once."""
    return tl.fma(lo_sum.to(tl.float32), 1.0 / LO_SCALE, hi_sum.to(tl.float32))


@triton.jit
def _pick_scales(max_score_bits, PICK_BITS: tl.constexpr):
    """Powers of two ``(scale, unscale)`` for summing picked scores with :func:`_fixed_point`, from the bit
    pattern of the largest (``[+0, 1]``, so its biased exponent is at most 127): every score times ``scale``
    is below ``2**(PICK_BITS + 1)``, the largest at least ``2**PICK_BITS`` (scores below ``2**(PICK_BITS -
    125)`` are scaled by ``2**126`` only); ``unscale = 1 / (scale * 2**PICK_BITS)``, a normal number."""
    e = tl.maximum(max_score_bits >> 23, PICK_BITS + 1)
    scale = ((254 + PICK_BITS - e) << 23).to(tl.float32, bitcast=True)
    unscale = ((e - PICK_BITS) << 23).to(tl.float32, bitcast=True)
    return scale, unscale


@triton.jit
def _prepare_bias(b, FAST_MATH: tl.constexpr):
    """float32 bias, NaN -> -inf (so that ``score + bias`` is never NaN: scores are finite).

    ``FAST_MATH``: the hardware ``max`` returns its non-NaN operand, one instruction.
    """
    b = b.to(tl.float32)
    if FAST_MATH:
        return tl.maximum(b, -float("inf"))
    return tl.where(b != b, -float("inf"), b)


@triton.jit
def _sigmoid(x, FAST_MATH: tl.constexpr):
    """sigmoid of float32 ``x``, with NaN counted as -inf (score +0); in ``[+0, 1]``, never ``-0.0``.

    ``FAST_MATH`` (NVIDIA GPUs): ``1 / (1 + 2^(-x log2 e))`` from the flush-to-zero
    ``ex2.approx`` and ``rcp.approx`` instructions, 6 instructions instead of the 13 of the
    IEEE-safe exp and division. Flushing is harmless here: ``2^(-x log2 e)`` below ``2^-126``
    adds nothing to 1, and the reciprocal is taken of ``(1 + t) * 2^-64`` (a normal number
    for every finite ``t``) and scaled back, so scores below ``2^-126`` keep their subnormal
    values instead of becoming 0. NaN is caught by the hardware ``min`` (which returns the
    non-NaN operand): ``min(NaN, +inf) = +inf``, ``1 / (1 + inf) = 0``. Versus
    ``torch.sigmoid``: a few float32 ulps, plus for negative ``x`` a relative error of about
    ``|x| * 2^-24`` from rounding ``x log2 e`` (as in ``tl.exp``).
    """
    if FAST_MATH:
        return _sigmoid_rcp(x) * _TWO_M64
    return tl.sigmoid(tl.where(x != x, -float("inf"), x))


@triton.jit
def _sigmoid_rcp(x, NAN_GUARD: tl.constexpr = True):
    """``2**64 * sigmoid(x)`` by ``ex2.approx``/``rcp.approx`` (:func:`_sigmoid` with ``FAST_MATH``); without
    ``NAN_GUARD`` NaN for a NaN ``x`` (the same bits for every other)."""
    u = x * -_LOG2E
    if NAN_GUARD:
        u = tl.minimum(u, float("inf"))
    t = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [tl.fma(t, _TWO_M64, _TWO_M64)],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _claim_tile(
    counter_ptr,  # () int32: a group's counter, counter_ptr + g * 32 of _two_level_kernel
    want,
):
    """If ``want``, lane 0 adds 1 to ``*counter_ptr`` (relaxed, device scope); a ``[1]`` int32 tensor holding the
    old value in lane 0 (``2**28`` without a claim). Nothing waits for the atomic until :func:`_claimed` reads it."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p, w; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; setp.ne.u32 w, $2, 0; "
        "and.pred p, p, w; mov.u32 $0, 0x10000000; @p atom.global.gpu.relaxed.add.u32 $0, [$1], 1; }",
        "=r,l,r", [counter_ptr + tl.zeros([1], tl.int32), want.to(tl.int32) + tl.zeros([1], tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _claimed(claim):
    """The value :func:`_claim_tile` returned, as a scalar (broadcast from lane 0)."""
    v = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r", [claim],
                                  dtype=tl.int32, is_pure=False, pack=1)
    return tl.max(v, axis=0)


@triton.jit
def _softmax_stats(row_max):
    """From a row's max logit: (the finite max to subtract, whether the row holds +inf)."""
    has_inf = row_max == float("inf")
    finite_max = tl.where((row_max > -float("inf")) & ~has_inf, row_max, 0.0)
    return finite_max, has_inf


@triton.jit
def _softmax_numerator(x, finite_max, has_inf):
    """exp(x - max), or the +inf experts' equal shares (1 each) when the row holds +inf."""
    return tl.where(has_inf, (x == float("inf")).to(tl.float32), tl.exp(x - finite_max))


@triton.jit
def _scores(x, finite_max, has_inf, total, NORMALIZATION_MODE: tl.constexpr, FAST_MATH: tl.constexpr):
    """Unbiased scores of prepared logits: sigmoid, or softmax from the row's statistics."""
    if NORMALIZATION_MODE == 0:
        return _sigmoid(x, FAST_MATH)
    return tl.where(total > 0, _softmax_numerator(x, finite_max, has_inf) / tl.where(total > 0, total, 1.0), 0.0)


@triton.jit
def _biased_scores(x, bias, finite_max, has_inf, total, NORMALIZATION_MODE: tl.constexpr, FAST_MATH: tl.constexpr):
    """``score + bias`` (:func:`_scores`), rounded once in every algorithm: the sigmoid's last product and the
    bias add are one explicit fused multiply-add (a compiler may fuse ``score * c + bias`` in one kernel and
    not in another)."""
    if NORMALIZATION_MODE == 0 and FAST_MATH:
        return tl.fma(_sigmoid_rcp(x), _TWO_M64, bias)
    return _scores(x, finite_max, has_inf, total, NORMALIZATION_MODE, FAST_MATH) + bias


@triton.jit
def _ordered_key(biased):
    """int32 whose integer order is the float order of ``biased`` (no NaN; never -0.0)."""
    bits = biased.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _select_round(key, ids, expert, slot, k, E_PAD: tl.constexpr):
    """One selection round: the largest key, the lowest expert holding it; mask it, record it."""
    best = tl.max(tl.max(key, axis=2), axis=1)[:, None, None]  # (BLOCK_T, 1, 1)
    first = tl.min(tl.min(tl.where(key == best, expert, E_PAD), axis=2), axis=1)[:, None, None]
    key = tl.where(expert == first, _EMPTY_KEY, key)
    ids = tl.where(slot == k, first, ids)
    return key, ids


@triton.jit
def _scan_select(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    bias_ptr,  # (E,) fp32|bf16|fp16, stride stride_bias
    row, row_off, row_ok, num_experts, stride_gn, stride_bias,
    router_output_multiplier,
    TOPK: tl.constexpr,
    SLOTS: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    FAST_MATH: tl.constexpr,
    TOTAL_BITS: tl.constexpr,
):
    """Exact selection by repeated argmax over a ``[BLOCK_T, NUM_CHUNKS, CHUNK]`` tile.

    ``row``, ``row_off`` and ``row_ok`` are ``(BLOCK_T, 1, 1)``. Returns
    ``(ids, finite_max, has_inf, total)``: ids ``(BLOCK_T, 1, SLOTS)`` int32 (slots past
    ``TOPK`` hold 0), and the softmax statistics ``(BLOCK_T, 1, 1)`` (placeholders under
    sigmoid).
    """
    E_PAD: tl.constexpr = NUM_CHUNKS * CHUNK
    # expert = chunk * CHUNK + lane; the innermost axis is the contiguous one.
    expert = tl.arange(0, NUM_CHUNKS)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
    expert_ok = expert < num_experts
    logits = tl.load(gating_output_ptr + row_off + expert * stride_gn, mask=expert_ok & row_ok, other=-float("inf"))
    # The bias is loaded through a pointer tile of the logits' shape so it gets their layout.
    bias_ptrs = tl.broadcast_to(bias_ptr + expert * stride_bias, logits.shape)
    bias = _prepare_bias(tl.load(bias_ptrs, mask=expert_ok, other=0.0), FAST_MATH)
    # Experts past the end are -inf after the multiplier too (a negative one would make the
    # -inf they were loaded as +inf, and softmax would give them all the mass).
    logits = tl.where(expert_ok, _prepare_logits(logits, router_output_multiplier, HAS_MULTIPLIER, NORMALIZATION_MODE,
                                                 FAST_MATH), -float("inf"))
    finite_max = tl.zeros_like(row_off).to(tl.float32)
    has_inf = finite_max != 0.0
    total = finite_max + 1.0
    if NORMALIZATION_MODE == 1:
        finite_max, has_inf = _softmax_stats(tl.max(tl.max(logits, axis=2), axis=1)[:, None, None])
        TOTAL_LO: tl.constexpr = 2.0**22 if TOTAL_BITS >= 14 else 2.0**(TOTAL_BITS + 8)
        hi, lo = _fixed_point(_softmax_numerator(logits, finite_max, has_inf) * (2.0**TOTAL_BITS), TOTAL_LO)
        total = _fixed_sum(tl.sum(tl.sum(hi, axis=2), axis=1)[:, None, None],
                           tl.sum(tl.sum(lo, axis=2), axis=1)[:, None, None], TOTAL_LO) * (2.0**-TOTAL_BITS)
    key = _ordered_key(_biased_scores(logits, bias, finite_max, has_inf, total, NORMALIZATION_MODE, FAST_MATH))
    key = tl.where(expert_ok, key, _EMPTY_KEY)

    # Outputs live in (BLOCK_T, 1, SLOTS) tensors derived from the tile's layout, so the
    # rounds need no layout conversion (no shared-memory round trip per round).
    slot = tl.arange(0, SLOTS)[None, None, :]
    ids = tl.zeros([row.shape[0], 1, SLOTS], dtype=tl.int32)
    if TOPK <= _UNROLL_MAX_TOPK:
        for k in tl.static_range(TOPK):
            key, ids = _select_round(key, ids, expert, slot, k, E_PAD)
    else:  # a loop, not unrolled: unrolling hundreds of rounds takes minutes to compile
        for k in range(TOPK):
            key, ids = _select_round(key, ids, expert, slot, k, E_PAD)
    return ids, finite_max, has_inf, total


@triton.jit
def _picked_scores(
    ptrs,  # pointer tile of ok's shape into gating_output (fp32|bf16|fp16): the picked experts' logits
    ok, router_output_multiplier, finite_max, has_inf, total,
    NORMALIZATION_MODE: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """Unbiased scores of the picked experts whose logits ``ptrs`` point at (re-read, in cache); 0 where not ``ok``."""
    return _logit_scores(tl.load(ptrs, mask=ok, other=-float("inf")), ok, router_output_multiplier, finite_max,
                         has_inf, total, NORMALIZATION_MODE, HAS_MULTIPLIER, FAST_MATH)


@triton.jit
def _logit_scores(
    x,  # the picked experts' raw logits (fp32|bf16|fp16), ok's shape
    ok, router_output_multiplier, finite_max, has_inf, total,
    NORMALIZATION_MODE: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
):
    """:func:`_picked_scores` of logits already read."""
    x = _prepare_logits(x, router_output_multiplier, HAS_MULTIPLIER, NORMALIZATION_MODE, FAST_MATH)
    return tl.where(ok, _scores(x, finite_max, has_inf, total, NORMALIZATION_MODE, FAST_MATH), 0.0)


@triton.jit
def _renormalizer(score_sum, route_scale, division_eps, HAS_EPS: tl.constexpr):
    """``route_scale / (sum + eps)``, or 0 for a zero denominator."""
    denom = score_sum
    if HAS_EPS:
        denom = denom + division_eps
    return tl.where(denom > 0, route_scale / tl.where(denom > 0, denom, 1.0), 0.0)


@triton.jit
def _write_outputs(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    row, row_off, row_ok, ids, slot, finite_max, has_inf, total,
    topk_weights_ptr,  # (T, topk) fp32, strides (stride_wm, stride_wk)
    topk_ids_ptr,  # (T, topk) int32|int64, strides (stride_im, stride_ik); -1 for padded tokens
    is_padding_ptr,  # (T,) bool, stride stride_pad, or None (no padding)
    stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
    router_output_multiplier, route_scale, division_eps,
    TOPK: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    FAST_MATH: tl.constexpr,
    PICK_BITS: tl.constexpr,
):
    """Weights of the picked experts, padding, and the stores; ``ids``/``slot`` broadcast against ``row``.

    The picked experts' logits are re-read (in cache) and only those ``TOPK`` scores are
    recomputed, renormalised by ``route_scale / (sum + eps)``; a zero denominator gives
    weights 0. Padded rows get id -1 and weight 0.
    """
    out_ok = row_ok & (slot < TOPK)
    picked_scores = _picked_scores(gating_output_ptr + row_off + ids * stride_gn, out_ok, router_output_multiplier,
                                   finite_max, has_inf, total, NORMALIZATION_MODE, HAS_MULTIPLIER, FAST_MATH)
    scale, unscale = _pick_scales(tl.max(picked_scores.to(tl.int32, bitcast=True), axis=-1, keep_dims=True),
                                  PICK_BITS)
    PICK_LO: tl.constexpr = 2.0**22 if PICK_BITS >= 14 else 2.0**(PICK_BITS + 8)
    hi, lo = _fixed_point(picked_scores * scale, PICK_LO)
    score_sum = _fixed_sum(tl.sum(hi, axis=-1, keep_dims=True), tl.sum(lo, axis=-1, keep_dims=True), PICK_LO) * unscale
    weights = picked_scores * _renormalizer(score_sum, route_scale, division_eps, HAS_EPS)
    if is_padding_ptr is not None:
        padded = tl.load(is_padding_ptr + row * stride_pad, mask=row_ok, other=0) != 0
        ids = tl.where(padded, -1, ids)
        weights = tl.where(padded, 0.0, weights)
    tl.store(topk_ids_ptr + row * stride_im + slot * stride_ik, ids, mask=out_ok)
    tl.store(topk_weights_ptr + row * stride_wm + slot * stride_wk, weights, mask=out_ok)


@triton.jit
def _routing_kernel(
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
    TOPK: tl.constexpr,
    TOPK_PADDED: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,  # 0 sigmoid, 1 softmax
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_MATH: tl.constexpr,
    TOTAL_BITS: tl.constexpr,  # softmax total: routetool_kernels.routing_policy.sum_bits(padded experts)
    PICK_BITS: tl.constexpr,  # sum of the picked scores: routetool_kernels.routing_policy.sum_bits(topk)
):
    """Scan algorithm. Grid ``(cdiv(num_tokens, BLOCK_T),)``: program ``p`` routes tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    row_ok = row < num_tokens
    row_off = row.to(tl.int64) * stride_gm
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    ids, finite_max, has_inf, total = _scan_select(
        gating_output_ptr, bias_ptr, row, row_off, row_ok, num_experts, stride_gn, stride_bias,
        router_output_multiplier, TOPK, TOPK_PADDED, NUM_CHUNKS, CHUNK, NORMALIZATION_MODE, HAS_MULTIPLIER, FAST_MATH, TOTAL_BITS,
    )
    _write_outputs(
        gating_output_ptr, row, row_off, row_ok, ids, tl.arange(0, TOPK_PADDED)[None, None, :], finite_max, has_inf,
        total, topk_weights_ptr, topk_ids_ptr, is_padding_ptr, stride_gn, stride_wm, stride_wk, stride_im, stride_ik,
        stride_pad, router_output_multiplier, route_scale, division_eps, TOPK, NORMALIZATION_MODE, HAS_MULTIPLIER,
        HAS_EPS, FAST_MATH, PICK_BITS,
    )


@triton.jit
def _load_slices(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    tile, num_tokens, num_experts, stride_gm, stride_gn,
    WIDTH: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    MASK_EXPERTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The logits of the ``BLOCK_T`` rows of ``tile`` as a tuple of ``NUM_SLICES`` ``(BLOCK_T, WIDTH)`` tensors.

    Rows past the end re-read the last row (always in bounds, so no row mask); experts past
    ``num_experts`` read ``-inf``.
    """
    col = tl.arange(0, WIDTH)[None, :]
    row = tl.minimum(tile * BLOCK_T + tl.arange(0, BLOCK_T)[:, None], num_tokens - 1)
    row_ptr = gating_output_ptr + row.to(tl.int64) * stride_gm + col * stride_gn
    xs = ()
    for v in tl.static_range(NUM_SLICES):
        if MASK_EXPERTS:
            xs = xs + (tl.load(row_ptr + v * WIDTH * stride_gn, mask=v * WIDTH + col < num_experts,
                               other=-float("inf")),)
        else:
            xs = xs + (tl.load(row_ptr + v * WIDTH * stride_gn),)
    return xs


@triton.jit
def _load_bias_slices(
    bias_ptr,  # (E,) fp32|bf16|fp16, stride stride_bias
    num_experts, stride_bias,
    WIDTH: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    MASK_EXPERTS: tl.constexpr,
    FAST_MATH: tl.constexpr,
):
    """The prepared bias (:func:`_prepare_bias`) as a tuple of ``NUM_SLICES`` ``(1, WIDTH)`` tensors, loaded once per program."""
    col = tl.arange(0, WIDTH)[None, :]
    bs = ()
    for v in tl.static_range(NUM_SLICES):
        if MASK_EXPERTS:
            b = tl.load(bias_ptr + (v * WIDTH + col) * stride_bias, mask=v * WIDTH + col < num_experts, other=0.0)
        else:
            b = tl.load(bias_ptr + (v * WIDTH + col) * stride_bias)
        bs = bs + (_prepare_bias(b, FAST_MATH),)
    return bs


@triton.jit
def _slice_logits(x, v, col, num_experts, router_output_multiplier,
                  WIDTH: tl.constexpr, MASK_EXPERTS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr,
                  NORMALIZATION_MODE: tl.constexpr, FAST_MATH: tl.constexpr):
    """Prepared logits of slice ``v``; experts past the end are -inf after the multiplier too."""
    x = _prepare_logits(x, router_output_multiplier, HAS_MULTIPLIER, NORMALIZATION_MODE, FAST_MATH)
    if MASK_EXPERTS:
        x = tl.where(v * WIDTH + col < num_experts, x, -float("inf"))
    return x


@triton.jit
def _write_picks(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    row, row_off, row_ok, rounds, pick_a, pick_b, finite_max, has_inf, total,
    topk_weights_ptr,  # (T, topk) fp32, strides (stride_wm, stride_wk)
    topk_ids_ptr,  # (T, topk) int32|int64, strides (stride_im, stride_ik); -1 for padded tokens
    is_padding_ptr,  # (T,) bool, stride stride_pad, or None (no padding)
    stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
    router_output_multiplier, route_scale, division_eps,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    FAST_MATH: tl.constexpr,
    PICK_BITS: tl.constexpr,
):
    """Weights and stores of the two-level kernel, from each column's (at most two) picks.

    ``rounds`` (``(BLOCK_T, WIDTH)`` int32) encodes the output slots of a column's picks:
    0 none; ``a + 1`` one pick, expert ``pick_a`` in slot ``a``; ``(a + 1) * 64 + b + 1``
    two picks, ``pick_a`` in slot ``a`` and ``pick_b`` in slot ``b``. The picked experts'
    logits are re-read (in cache) and only those scores recomputed, renormalised by
    ``route_scale / (sum + eps)``; a zero denominator gives weights 0. Padded rows get id -1
    and weight 0.
    """
    two = rounds > 64
    ok_a = row_ok & (rounds > 0)
    ok_b = row_ok & two
    slot_a = tl.where(two, rounds >> 6, rounds) - 1  # (rounds >= 0: shifts and masks, no signed-division fixups)
    slot_b = (rounds & 63) - 1
    # The picks are data, but a row's picks lie along its columns: the hint keeps the gathers
    # in the row-per-warp layout instead of converting them through shared memory. Their
    # alignment is unknown, so nothing is vectorised.
    ptr_a = tl.max_contiguous(gating_output_ptr + row_off + pick_a * stride_gn, [1, pick_a.shape[1]])
    ptr_b = tl.max_contiguous(gating_output_ptr + row_off + pick_b * stride_gn, [1, pick_b.shape[1]])
    score_a = _picked_scores(ptr_a, ok_a, router_output_multiplier, finite_max, has_inf, total, NORMALIZATION_MODE,
                             HAS_MULTIPLIER, FAST_MATH)
    score_b = _picked_scores(ptr_b, ok_b, router_output_multiplier, finite_max, has_inf, total, NORMALIZATION_MODE,
                             HAS_MULTIPLIER, FAST_MATH)
    scale, unscale = _pick_scales(tl.max(tl.maximum(score_a.to(tl.int32, bitcast=True),
                                                    score_b.to(tl.int32, bitcast=True)), axis=1)[:, None], PICK_BITS)
    PICK_LO: tl.constexpr = 2.0**22 if PICK_BITS >= 14 else 2.0**(PICK_BITS + 8)
    hi_a, lo_a = _fixed_point(score_a * scale, PICK_LO)
    hi_b, lo_b = _fixed_point(score_b * scale, PICK_LO)
    score_sum = _fixed_sum(tl.sum(hi_a + hi_b, axis=1)[:, None], tl.sum(lo_a + lo_b, axis=1)[:, None], PICK_LO) * unscale
    inv_sum_scaled = _renormalizer(score_sum, route_scale, division_eps, HAS_EPS)
    id_a = pick_a
    id_b = pick_b
    w_a = score_a * inv_sum_scaled
    w_b = score_b * inv_sum_scaled
    if is_padding_ptr is not None:
        padded = tl.load(is_padding_ptr + row * stride_pad, mask=row_ok, other=0) != 0
        id_a = tl.where(padded, -1, id_a)
        id_b = tl.where(padded, -1, id_b)
        w_a = tl.where(padded, 0.0, w_a)
        w_b = tl.where(padded, 0.0, w_b)
    tl.store(topk_ids_ptr + row * stride_im + slot_a * stride_ik, id_a, mask=ok_a)
    tl.store(topk_weights_ptr + row * stride_wm + slot_a * stride_wk, w_a, mask=ok_a)
    tl.store(topk_ids_ptr + row * stride_im + slot_b * stride_ik, id_b, mask=ok_b)
    tl.store(topk_weights_ptr + row * stride_wm + slot_b * stride_wk, w_b, mask=ok_b)


@triton.jit
def _slice_scan(
    xs, bs, col, num_experts, router_output_multiplier, finite_max, has_inf, total,
    TOPK: tl.constexpr,
    WIDTH: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    MASK_EXPERTS: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    FAST_MATH: tl.constexpr,
):
    """Exact repeated argmax over the logits already in registers (the two-level kernel's redo).

    ``xs``: the tile's ``NUM_SLICES`` raw ``(BLOCK_T, WIDTH)`` logit slices; ``bs``: the
    prepared bias slices. Every round takes the largest key of the row, the lowest expert
    holding it, and masks it out; the pick of round ``k`` goes to column ``k`` of the
    returned ``(BLOCK_T, WIDTH)`` int32 ids. Works in the slices' own layout, so it needs
    no shared memory and few registers beyond the ones the fast path holds anyway.
    """
    E_BIG: tl.constexpr = (NUM_SLICES + 1) * WIDTH
    keys = ()
    for v in tl.static_range(NUM_SLICES):
        x = _slice_logits(xs[v], v, col, num_experts, router_output_multiplier, WIDTH, MASK_EXPERTS, HAS_MULTIPLIER,
                          NORMALIZATION_MODE, FAST_MATH)
        key = _ordered_key(_biased_scores(x, bs[v], finite_max, has_inf, total, NORMALIZATION_MODE, FAST_MATH))
        if MASK_EXPERTS:
            key = tl.where(v * WIDTH + col < num_experts, key, _EMPTY_KEY)
        keys = keys + (key,)
    ids = tl.zeros(keys[0].shape, dtype=tl.int32)
    for k in tl.static_range(TOPK):
        lane_best = keys[0]
        for v in tl.static_range(1, NUM_SLICES):
            lane_best = tl.maximum(lane_best, keys[v])
        best = tl.max(lane_best, axis=1)[:, None]
        lane_first = tl.where(keys[NUM_SLICES - 1] == best, (NUM_SLICES - 1) * WIDTH + col, E_BIG)
        for v in tl.static_range(NUM_SLICES - 2, -1, -1):  # lower slices last: they hold the lower experts
            lane_first = tl.where(keys[v] == best, v * WIDTH + col, lane_first)
        first = tl.min(lane_first, axis=1)[:, None]
        masked = ()
        for v in tl.static_range(NUM_SLICES):
            masked = masked + (tl.where(v * WIDTH + col == first, _EMPTY_KEY, keys[v]),)
        keys = masked
        ids = tl.where(col == k, first, ids)
    return ids


@triton.jit
def _two_level_tile(
    tile, xs, bs,
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, strides (stride_gm, stride_gn)
    topk_weights_ptr,  # (T, topk) fp32, strides (stride_wm, stride_wk)
    topk_ids_ptr,  # (T, topk) int32|int64, strides (stride_im, stride_ik); -1 for padded tokens
    is_padding_ptr,  # (T,) bool, stride stride_pad, or None (no padding)
    num_tokens, num_experts,
    stride_gm, stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
    router_output_multiplier, route_scale, division_eps,
    TOPK: tl.constexpr,
    WIDTH: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    MASK_EXPERTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    FAST_MATH: tl.constexpr,
    TOTAL_BITS: tl.constexpr,
    PICK_BITS: tl.constexpr,
):
    """Route the ``BLOCK_T`` tokens of ``tile`` from their logits ``xs`` and the bias ``bs`` (see :func:`_two_level_kernel`)."""
    col = tl.arange(0, WIDTH)[None, :]  # (1, WIDTH); also the output slot of the first TOPK columns
    row = tile * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # (BLOCK_T, 1)
    row_ok = row < num_tokens
    row_off = tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_gm
    finite_max = tl.zeros([BLOCK_T, 1], dtype=tl.float32)
    has_inf = finite_max != 0.0
    total = finite_max + 1.0
    if NORMALIZATION_MODE == 1:
        run_max = tl.full([BLOCK_T, WIDTH], -float("inf"), tl.float32)
        for v in tl.static_range(NUM_SLICES):
            run_max = tl.maximum(run_max, _slice_logits(xs[v], v, col, num_experts, router_output_multiplier,
                                                        WIDTH, MASK_EXPERTS, HAS_MULTIPLIER, 1, FAST_MATH))
        finite_max, has_inf = _softmax_stats(tl.max(run_max, axis=1)[:, None])
        TOTAL_LO: tl.constexpr = 2.0**22 if TOTAL_BITS >= 14 else 2.0**(TOTAL_BITS + 8)
        run_hi = tl.zeros([BLOCK_T, WIDTH], dtype=tl.int32)
        run_lo = tl.zeros([BLOCK_T, WIDTH], dtype=tl.int32)
        for v in tl.static_range(NUM_SLICES):
            x = _slice_logits(xs[v], v, col, num_experts, router_output_multiplier, WIDTH, MASK_EXPERTS,
                              HAS_MULTIPLIER, 1, FAST_MATH)
            hi, lo = _fixed_point(_softmax_numerator(x, finite_max, has_inf) * (2.0**TOTAL_BITS), TOTAL_LO)
            run_hi += hi
            run_lo += lo
        total = _fixed_sum(tl.sum(run_hi, axis=1)[:, None], tl.sum(run_lo, axis=1)[:, None], TOTAL_LO) * (2.0**-TOTAL_BITS)

    # Level 1: per column, the two best (biased score, slice) in order and the third-best
    # score, over the slices in expert order. Only a strictly greater score moves an entry
    # up, so of equal scores the lower expert stays ahead. Placeholders: -inf, slice
    # NUM_SLICES (an expert index above all real ones, so real experts win ties with it).
    for v in tl.static_range(NUM_SLICES):
        x = _slice_logits(xs[v], v, col, num_experts, router_output_multiplier, WIDTH, MASK_EXPERTS, HAS_MULTIPLIER,
                          NORMALIZATION_MODE, FAST_MATH)
        biased = _biased_scores(x, bs[v], finite_max, has_inf, total, NORMALIZATION_MODE, FAST_MATH)
        if MASK_EXPERTS:
            biased = tl.where(v * WIDTH + col < num_experts, biased, -float("inf"))
        if v == 0:
            m1 = biased
            j1 = tl.zeros([BLOCK_T, WIDTH], dtype=tl.int32)
            m2 = tl.full([BLOCK_T, WIDTH], -float("inf"), tl.float32)
            j2 = j1 + NUM_SLICES
            m3 = m2
        elif v == 1:
            above1 = biased > m1
            m2 = tl.minimum(biased, m1)
            m1 = tl.maximum(biased, m1)
            j2 = tl.where(above1, 0, 1)
            j1 = 1 - j2
        else:
            above1 = biased > m1
            above2 = biased > m2
            m3 = tl.maximum(m3, tl.minimum(biased, m2))
            m2 = tl.maximum(m2, tl.minimum(biased, m1))
            m1 = tl.maximum(m1, biased)
            j2 = tl.where(above1, j1, tl.where(above2, v, j2))
            j1 = tl.where(above1, v, j1)

    # Level 2: merge the columns' sorted pairs with one reduction per round: every column whose
    # head holds the round's largest key pops it (its second entry becomes the head). The
    # column records the rounds it popped in, so the pick of round k goes to output slot k:
    # ``rounds = rounds * 64 + k + 1`` per pop (a column pops at most twice when exact).
    # Equal keys always meet as heads (everything above them pops first), so a tie shows as
    # more than ``TOPK`` pops in all; like a third entry at or above the k-th pick, it sends
    # the tile to the redo.
    k1 = _ordered_key(m1)
    k2 = _ordered_key(m2)
    rounds = tl.zeros([BLOCK_T, WIDTH], dtype=tl.int32)
    for k in tl.static_range(TOPK):
        kth = tl.max(k1, axis=1)[:, None]
        popped = k1 == kth
        k1 = tl.where(popped, k2, k1)
        k2 = tl.where(popped, _EMPTY_KEY, k2)
        rounds = tl.where(popped, rounds * 64 + (k + 1), rounds)
    # A column pops a third time only once every head is empty (ties used up all the pairs),
    # and the last round's key then is the empty key: such rows (whose ``rounds`` may have
    # overflowed) are unproven too.
    pops = (rounds > 0).to(tl.int32) + (rounds > 64).to(tl.int32) + tl.where(kth == _EMPTY_KEY, TOPK + 1, 0)
    if NUM_SLICES > 2:
        pops += tl.where(_ordered_key(m3) >= kth, TOPK + 1, 0)
    unproven = tl.sum(pops) - TOPK * BLOCK_T  # every round pops at least one column: > 0 iff some row is unproven
    if unproven > 0:
        # Exact repeated argmax over the logits still in registers, in the same layout; its
        # pick k sits in column k. Each branch stores its own picks (with one shared store,
        # LLVM's vectorizer hit an assertion for 512 experts in two-row tiles).
        ids = _slice_scan(xs, bs, col, num_experts, router_output_multiplier, finite_max, has_inf, total, TOPK,
                          WIDTH, NUM_SLICES, MASK_EXPERTS, NORMALIZATION_MODE, HAS_MULTIPLIER, FAST_MATH)
        _write_outputs(
            gating_output_ptr, row, row_off, row_ok, ids, col, finite_max, has_inf, total, topk_weights_ptr,
            topk_ids_ptr, is_padding_ptr, stride_gn, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
            router_output_multiplier, route_scale, division_eps, TOPK, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS,
            FAST_MATH, PICK_BITS,
        )
    else:
        _write_picks(
            gating_output_ptr, row, row_off, row_ok, rounds, j1 * WIDTH + col, j2 * WIDTH + col, finite_max, has_inf,
            total, topk_weights_ptr, topk_ids_ptr, is_padding_ptr, stride_gn, stride_wm, stride_wk, stride_im,
            stride_ik, stride_pad, router_output_multiplier, route_scale, division_eps, NORMALIZATION_MODE,
            HAS_MULTIPLIER, HAS_EPS, FAST_MATH, PICK_BITS,
        )


@triton.jit(do_not_specialize=["stride_wk", "stride_ik"])  # no vectorised store layout for the outputs
def _two_level_kernel(
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
    tiles_per_program,
    TOPK: tl.constexpr,
    WIDTH: tl.constexpr,  # columns per row (power of two, >= TOPK)
    NUM_SLICES: tl.constexpr,  # cdiv(num_experts, WIDTH)
    MASK_EXPERTS: tl.constexpr,  # num_experts < NUM_SLICES * WIDTH
    BLOCK_T: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_MATH: tl.constexpr,
    TOTAL_BITS: tl.constexpr,  # softmax total: routetool_kernels.routing_policy.sum_bits(padded experts)
    PICK_BITS: tl.constexpr,  # sum of the picked scores: routetool_kernels.routing_policy.sum_bits(topk)
    PERSISTENT: tl.constexpr,
    PING_PONG: tl.constexpr,  # persistent loop over two tiles per iteration (see below)
    counter_ptr=None,  # (TILE_GROUPS * 32,) int32, zero between launches (tile_counters); None unless DYNAMIC
    DYNAMIC: tl.constexpr = False,  # persistent loop claiming tiles from the counters (see below)
    TILE_GROUPS: tl.constexpr = 16,
):
    """Two-level algorithm over tiles of ``BLOCK_T`` tokens.

    Grid ``(cdiv(num_tokens, BLOCK_T),)``, one program per tile; or, ``PERSISTENT``, fewer:
    ``(programs_per_sm * SM count,)`` where that is below the tile count, program ``p`` taking
    tiles ``p, p + grid, ...`` (``tiles_per_program`` of them at most) and loading each
    tile's logits one tile ahead, so that the memory latency of the next tile overlaps the
    work on this one. With ``PING_PONG`` the loop takes two tiles per iteration, alternating
    between two register sets, so no logits are copied between iterations (chosen while a
    thread holds at most :data:`routetool_kernels.routing_policy.PING_PONG_MAX_SLICES` logit slices:
    beyond that the second set costs more registers, and resident programs, than the
    copies). With ``DYNAMIC`` a
    persistent program takes two tiles by index and then claims tiles from ``counter_ptr``,
    pairs of them with ``PING_PONG``, one at a time without: the static split left SMs idle
    for 13% of the kernel and 24 of 32 warps resident on average (the programs launched last
    ended last; Nsight Compute, benchmarks/NOTES.md), the claimed one 29 of 32.

    Expert ``e`` of a row sits in column ``e % WIDTH`` of slice ``e // WIDTH``. Slices are
    streamed once; each column keeps its two best (score, expert) entries in order and the
    score of its third best. Merging the columns' sorted pairs with ``TOPK`` rounds of
    (largest head key, pop it) gives the exact top-k whenever no column holds three of
    them and no two heads tie; the third-best scores (all below the k-th pick) and the pop
    count (exactly ``TOPK``) prove that, and a tile where they do not is redone by repeated
    argmax over its logits in registers (:func:`_slice_scan`). Each expert is touched a
    constant number of times instead of ``TOPK`` times.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    bs = _load_bias_slices(bias_ptr, num_experts, stride_bias, WIDTH, NUM_SLICES, MASK_EXPERTS, FAST_MATH)
    if PERSISTENT:
        num_tiles = tl.cdiv(num_tokens, BLOCK_T)
        xs = _load_slices(gating_output_ptr, pid, num_tokens, num_experts, stride_gm, stride_gn, WIDTH, NUM_SLICES,
                          MASK_EXPERTS, BLOCK_T)
        if DYNAMIC:
            # Programs fall in TILE_GROUPS groups (pid % TILE_GROUPS), group g owning the tiles
            # g + TILE_GROUPS * j (j < T). A program's first two tiles are static (j = q and q + P, for its
            # index q among the P programs of its group); later ones come from its group's counter, each
            # claim issued a tile (one-tile loop) or a pair of tiles (PING_PONG) ahead of its use. So
            # programs that started early or met easy tiles take more, and all end together; one counter
            # per group keeps the atomics on one address few. The grid is smaller than the tile count,
            # so P <= T in every group.
            g = pid % TILE_GROUPS
            q = pid // TILE_GROUPS
            P = (tl.num_programs(0) - g + TILE_GROUPS - 1) // TILE_GROUPS
            T = (num_tiles - g + TILE_GROUPS - 1) // TILE_GROUPS
            group_ptr = counter_ptr + g * 32  # one 128-byte line per group
            # A program claims only where the iteration that reads the claim will run, and stops after
            # the first claim that fails (returns no tile), so a launch makes exactly D + C claims in a
            # group (D: its dynamic tiles or pairs, C: its programs that claim at all); the program whose
            # claim returns the last value, D + C - 1, knows every other claim is done and sets the
            # counter back to 0 for the next launch.
            if PING_PONG:
                # Pairs j = 2 P + 2 c, + 1 for claim c, claimed a pair ahead; every program claims.
                D = (tl.maximum(T - 2 * P, 0) + 1) // 2
                C = P
            else:
                # One tile per iteration, j = 2 P + c for claim c, claimed two tiles ahead; a program
                # claims only if its second static tile exists (q + P < T).
                D = tl.maximum(T - 2 * P, 0)
                C = tl.minimum(P, T - P)
            a_j = q
            b_j = q + P
            claim = _claim_tile(group_ptr, (a_j if PING_PONG else b_j) < T)
            while a_j < T:
                ys = _load_slices(gating_output_ptr, g + TILE_GROUPS * b_j, num_tokens, num_experts, stride_gm,
                                  stride_gn, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T)
                _two_level_tile(
                    g + TILE_GROUPS * a_j, xs, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr,
                    is_padding_ptr, num_tokens, num_experts, stride_gm, stride_gn, stride_wm, stride_wk, stride_im,
                    stride_ik, stride_pad, router_output_multiplier, route_scale, division_eps, TOPK, WIDTH,
                    NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS,
                    FAST_MATH, TOTAL_BITS, PICK_BITS,
                )
                c = _claimed(claim)
                tl.atomic_xchg(group_ptr, 0, mask=c == D + C - 1, sem="relaxed")
                if PING_PONG:
                    a_j = 2 * P + 2 * c
                    xs = _load_slices(gating_output_ptr, g + TILE_GROUPS * a_j, num_tokens, num_experts,
                                      stride_gm, stride_gn, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T)
                    if b_j < T:
                        _two_level_tile(
                            g + TILE_GROUPS * b_j, ys, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr,
                            is_padding_ptr, num_tokens, num_experts, stride_gm, stride_gn, stride_wm, stride_wk,
                            stride_im, stride_ik, stride_pad, router_output_multiplier, route_scale,
                            division_eps, TOPK, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE,
                            HAS_MULTIPLIER, HAS_EPS, FAST_MATH, TOTAL_BITS, PICK_BITS,
                        )
                    b_j = a_j + 1
                    claim = _claim_tile(group_ptr, a_j < T)
                else:
                    xs = ys
                    a_j = b_j
                    b_j = tl.minimum(2 * P + c, T)  # (no claim read: c = 2**28, no tile)
                    claim = _claim_tile(group_ptr, b_j < T)
        elif PING_PONG:
            # Two tiles per iteration, in two register sets: each set is refilled once its tile
            # is done, so nothing is copied between iterations (twice the code, and the registers
            # of two register sets of logits live at once).
            for it in range(0, tiles_per_program, 2):
                tile = pid + it * tl.num_programs(0)
                ys = _load_slices(gating_output_ptr, tile + tl.num_programs(0), num_tokens, num_experts, stride_gm,
                                  stride_gn, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T)
                if tile < num_tiles:
                    _two_level_tile(
                        tile, xs, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr, is_padding_ptr,
                        num_tokens, num_experts, stride_gm, stride_gn, stride_wm, stride_wk, stride_im,
                        stride_ik, stride_pad, router_output_multiplier, route_scale, division_eps, TOPK, WIDTH,
                        NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS,
                        FAST_MATH, TOTAL_BITS, PICK_BITS,
                    )
                xs = _load_slices(gating_output_ptr, tile + 2 * tl.num_programs(0), num_tokens, num_experts,
                                  stride_gm, stride_gn, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T)
                if tile + tl.num_programs(0) < num_tiles:
                    _two_level_tile(
                        tile + tl.num_programs(0), ys, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr,
                        is_padding_ptr, num_tokens, num_experts, stride_gm, stride_gn, stride_wm, stride_wk,
                        stride_im, stride_ik, stride_pad, router_output_multiplier, route_scale, division_eps, TOPK,
                        WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS,
                        FAST_MATH, TOTAL_BITS, PICK_BITS,
                    )
        else:
            for it in range(0, tiles_per_program):
                tile = pid + it * tl.num_programs(0)
                cur = xs
                xs = _load_slices(gating_output_ptr, tile + tl.num_programs(0), num_tokens, num_experts, stride_gm,
                                  stride_gn, WIDTH, NUM_SLICES, MASK_EXPERTS, BLOCK_T)
                if tile < num_tiles:
                    _two_level_tile(
                        tile, cur, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr, is_padding_ptr,
                        num_tokens, num_experts, stride_gm, stride_gn, stride_wm, stride_wk, stride_im,
                        stride_ik, stride_pad, router_output_multiplier, route_scale, division_eps, TOPK, WIDTH,
                        NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS,
                        FAST_MATH, TOTAL_BITS, PICK_BITS,
                    )
    else:  # (the interpreter cannot loop to a runtime bound)
        xs = _load_slices(gating_output_ptr, pid, num_tokens, num_experts, stride_gm, stride_gn, WIDTH, NUM_SLICES,
                          MASK_EXPERTS, BLOCK_T)
        _two_level_tile(
            pid, xs, bs, gating_output_ptr, topk_weights_ptr, topk_ids_ptr, is_padding_ptr, num_tokens,
            num_experts, stride_gm, stride_gn, stride_wm, stride_wk, stride_im, stride_ik,
            stride_pad, router_output_multiplier, route_scale, division_eps, TOPK, WIDTH,
            NUM_SLICES, MASK_EXPERTS, BLOCK_T, NORMALIZATION_MODE, HAS_MULTIPLIER, HAS_EPS, FAST_MATH, TOTAL_BITS, PICK_BITS,
        )


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
    WORDS: tl.constexpr = False,
):
    """The raw values of experts ``[8c, 8c + 8)`` for every row and lane: two ``(BLOCK_T, LANES, VEC)`` tiles of
    16-byte loads (the second the first again when ``VEC`` is 8); experts past ``num_experts`` read 0. ``WORDS``:
    ``base`` points at int32 words of two bf16 logits each (``col`` 0 .. 3, unit stride, an even expert count), and
    the tiles are those words."""
    if WORDS:
        w = c * 4 + col
        if MASK_EXPERTS:
            lo = tl.load(base + w, mask=2 * w < num_experts, other=0)
        else:
            lo = tl.load(base + w)
        return lo, lo
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
def _chunk_columns(lo, hi, VEC: tl.constexpr, WORDS: tl.constexpr = False):
    """The 8 columns of :func:`_load_chunk`'s tiles, as a tuple of ``(BLOCK_T, LANES)`` tensors (``WORDS``: float32,
    each bf16 logit shifted into the high half of a word: one instruction each)."""
    if WORDS:
        ws = _columns(lo, 4)
        cols = ()
        for i in tl.static_range(4):
            cols = cols + ((ws[i] << 16).to(tl.float32, bitcast=True),
                           (ws[i] & -65536).to(tl.float32, bitcast=True))
    elif VEC == 8:
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
    """:func:`_biased_scores` (sigmoid) without its NaN guards on ``x`` and ``bias``: the same bits for every
    non-NaN input, NaN for a NaN one (the caller's row sum catches it)."""
    if FAST_MATH:
        return tl.fma(_sigmoid_rcp(x, False), _TWO_M64, bias)
    return tl.sigmoid(x) + bias


@triton.jit
def _row_keys(
    xlo, xhi, blo, bhi,  # chunk c's logit and bias tiles (_load_chunk)
    num_experts, router_output_multiplier, base_bits, nan_sum,
    c,  # (1, LANES) int32: each lane's chunk
    key_scale,  # (BLOCK_T, 1) uint32: 2**INDEX_BITS in a register of each thread
    VEC: tl.constexpr, BIAS_VEC: tl.constexpr, MASK_EXPERTS: tl.constexpr, INDEX_BITS: tl.constexpr,
    EXACT: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr, WORDS: tl.constexpr = False,
):
    """Keys (``(BLOCK_T, LANES)``) of the 8 experts of each lane's chunk ``c`` for every row, and ``nan_sum``
    plus their biased scores.

    Window keys (uint32) from the unguarded scores, whose NaNs (a NaN logit or bias) make the row sum NaN;
    or with ``EXACT`` uint64 keys (``(order-preserving image of the biased score, as unsigned) << 32`` plus
    the expert bits) from the guarded ones. Experts past ``num_experts`` get key 0, below every real expert.
    """
    xs = _chunk_columns(xlo, xhi, VEC, WORDS)
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
            # (key_scale: 2**INDEX_BITS in a register, so that the product is an IMAD on the FMA pipe rather than
            # a LEA and a VIADD on the ALU pipe, the rows algorithm's busiest)
            key = tl.maximum(bits, base_bits).to(tl.uint32, bitcast=True) * key_scale + (off - j)
        if MASK_EXPERTS:
            key = tl.where(e0 + j < num_experts, key, 0)
        keys = keys + (key,)
    return keys, nan_sum


@triton.jit
def _load_tile(
    gbase,  # (BLOCK_T, 1) pointer tile: each row's first expert
    i,  # the tile: experts [i * W, (i + 1) * W), W = LANES * TILE * 8
    num_experts, stride,
    LANES: tl.constexpr, TILE: tl.constexpr, MASK_EXPERTS: tl.constexpr, WORDS: tl.constexpr = False,
):
    """One ``(BLOCK_T, W)`` tile of logits, loaded as the compiler coalesces it (a row's threads read adjacent
    16-byte pieces); experts past ``num_experts`` read 0. ``WORDS``: ``gbase`` points at int32 words of two bf16
    logits each (unit stride, an even expert count), and the tile is ``W / 2`` words a row."""
    W: tl.constexpr = LANES * TILE * (4 if WORDS else 8)
    e = i * W + tl.arange(0, W)[None, :]
    if WORDS:
        if MASK_EXPERTS:
            x = tl.load(gbase + e, mask=2 * e < num_experts, other=0)
        else:
            x = tl.load(gbase + e)
    elif MASK_EXPERTS:
        x = tl.load(gbase + e * stride, mask=e < num_experts, other=0.0)
    else:
        x = tl.load(gbase + e * stride)
    return x


@triton.jit
def _tile_chunks(x, LANES: tl.constexpr, TILE: tl.constexpr, WORDS: tl.constexpr = False):
    """:func:`_load_tile`'s tile as ``TILE`` ``(BLOCK_T, LANES, C)`` tensors whose last axis a thread holds (``C``
    8 logits, or with ``WORDS`` 4 words): tensor ``g``, lane ``l`` holds the tile's chunk ``g * LANES + l`` (the
    splits move the tile through shared memory once, into each lane's registers)."""
    C: tl.constexpr = 4 if WORDS else 8
    y = tl.permute(tl.reshape(x, [x.shape[0], TILE, LANES, C]), (0, 2, 3, 1))  # (BLOCK_T, LANES, C, TILE)
    if TILE == 1:
        chunks = (tl.reshape(y, [x.shape[0], LANES, C]),)
    elif TILE == 2:
        c0, c1 = tl.split(y)
        chunks = (c0, c1)
    elif TILE == 4:
        a, b = tl.split(tl.reshape(y, [x.shape[0], LANES, C, 2, 2]))  # (0, 2), (1, 3)
        c0, c2 = tl.split(a)
        c1, c3 = tl.split(b)
        chunks = (c0, c1, c2, c3)
    else:
        a, b = tl.split(tl.reshape(y, [x.shape[0], LANES, C, 4, 2]))  # (0, 2, 4, 6), (1, 3, 5, 7)
        a0, a1 = tl.split(tl.reshape(a, [x.shape[0], LANES, C, 2, 2]))  # (0, 4), (2, 6)
        b0, b1 = tl.split(tl.reshape(b, [x.shape[0], LANES, C, 2, 2]))  # (1, 5), (3, 7)
        c0, c4 = tl.split(a0)
        c2, c6 = tl.split(a1)
        c1, c5 = tl.split(b0)
        c3, c7 = tl.split(b1)
        chunks = (c0, c1, c2, c3, c4, c5, c6, c7)
    return chunks


@triton.jit
def _row_step(
    best, nan_sum, xlo, xhi, j, gbase, col, bbase, bcol, lane, num_experts, stride_gn, stride_bias,
    router_output_multiplier, base_bits, key_scale,
    ITERS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BIAS_VEC: tl.constexpr, MASK_EXPERTS: tl.constexpr,
    INDEX_BITS: tl.constexpr, EXACT: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
    AHEAD: tl.constexpr, WORDS: tl.constexpr,
):
    """One chunk of :func:`_row_select`'s loop: the keys of iteration ``j``'s chunk (its logits ``xlo, xhi``, loaded
    ``AHEAD`` iterations before), that chunk's slot reloaded with iteration ``j + AHEAD``'s logits, and the
    chunk's keys merged into ``best``. Returns ``(best, nan_sum, xlo, xhi)``."""
    c = j * LANES + lane
    qlo, qhi = _load_chunk(bbase, bcol, c[:, :, None], num_experts, stride_bias, BIAS_VEC, MASK_EXPERTS)
    keys, nan_sum = _row_keys(xlo, xhi, qlo, qhi, num_experts, router_output_multiplier, base_bits, nan_sum, c,
                              key_scale, VEC, BIAS_VEC, MASK_EXPERTS, INDEX_BITS, EXACT, HAS_MULTIPLIER, FAST_MATH,
                              WORDS)
    nxt = tl.minimum(j + AHEAD, ITERS - 1) * LANES + lane
    xlo, xhi = _load_chunk(gbase, col, nxt[:, :, None], num_experts, stride_gn, VEC, MASK_EXPERTS, WORDS)
    return _keep_best8(best, _sort8(*keys)), nan_sum, xlo, xhi


@triton.jit
def _row_select(
    gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias, router_output_multiplier, base_bits,
    ITERS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BIAS_VEC: tl.constexpr, MASK_EXPERTS: tl.constexpr,
    INDEX_BITS: tl.constexpr, EXACT: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
    AHEAD: tl.constexpr, TILE: tl.constexpr, WORDS: tl.constexpr = False, logits_desc=None, bias_desc=None,
    TMA: tl.constexpr = False, STAGES: tl.constexpr = 1,
):
    """The best 8 keys of every row, descending (8 ``(BLOCK_T,)`` tensors), and the row sums of the biased
    scores (window keys only; NaN where one is).

    ``LANES`` threads share a row: in iteration ``i`` lane ``l`` takes chunk ``i * LANES + l`` (8 experts), so
    a row's lanes read adjacent 16-byte pieces. A loop of ``ITERS`` iterations in steps of ``AHEAD`` (1, 2 or 4,
    dividing ``ITERS``): iteration ``i`` loads its own bias, makes its chunk's keys, reloads that chunk's
    registers with iteration ``i + AHEAD``'s logits (:func:`_row_step`; the last iterations re-read the last
    chunk, in cache) and merges its keys; then the lanes' lists merge (a reduction whose step keeps the best 8
    of two sorted lists).

    ``TMA`` (``TILE`` > 0, ``WORDS``, no masked experts; the program's rows are ``program_id * BLOCK_T`` on): each
    tile of logits and of bias is copied into shared memory by the tensor-memory accelerator (``logits_desc``: a
    Triton tensor descriptor of the logits as int32 words, blocks of ``BLOCK_T x LANES * TILE * 4``; ``bias_desc``:
    of the bias as ``(1, num_experts)``, blocks of ``LANES * TILE * 8``), ``STAGES`` tiles in flight, and each
    thread reads its chunks from there: no per-thread global loads. Rows past the tensor's last read 0. The same
    keys in the same order, so the same picks.
    """
    KEY: tl.constexpr = tl.uint64 if EXACT else tl.uint32
    if WORDS:  # int32 words of two bf16 logits (unit stride, an even row stride)
        gbase = gating_output_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (row_off // 2)[:, None, None]
        col = tl.arange(0, 4)[None, None, :]
    else:
        gbase = gating_output_ptr + row_off[:, None, None]
        col = tl.arange(0, VEC)[None, None, :]
    bbase = bias_ptr + tl.zeros_like(row_off[:, None, None])
    # 2**INDEX_BITS, from each thread's row so that the compiler keeps it in a register of its own (row_off >= 0)
    key_scale = ((1 << INDEX_BITS) | (row_off >> 63).to(tl.int32)).to(tl.uint32, bitcast=True)[:, None]
    bcol = tl.arange(0, BIAS_VEC)[None, None, :]
    lane = tl.arange(0, LANES)[None, :]
    # AHEAD slots (a, b, c, d), each loop-carried: slot s holds chunk i + s of iteration i (a step of AHEAD chunks)
    # and is reloaded in place with chunk i + s + AHEAD once its keys are made, so that no register copy at the
    # loop's end waits for a load (the last iterations re-read the last chunk, in cache)
    alo, ahi = _load_chunk(gbase, col, lane[:, :, None], num_experts, stride_gn, VEC, MASK_EXPERTS, WORDS)
    blo, bhi = alo, ahi
    clo, chi = alo, ahi
    dlo, dhi = alo, ahi
    if AHEAD >= 2:
        blo, bhi = _load_chunk(gbase, col, (min(1, ITERS - 1) * LANES + lane)[:, :, None], num_experts, stride_gn,
                               VEC, MASK_EXPERTS, WORDS)
    if AHEAD >= 4:
        clo, chi = _load_chunk(gbase, col, (min(2, ITERS - 1) * LANES + lane)[:, :, None], num_experts, stride_gn,
                               VEC, MASK_EXPERTS, WORDS)
        dlo, dhi = _load_chunk(gbase, col, (min(3, ITERS - 1) * LANES + lane)[:, :, None], num_experts, stride_gn,
                               VEC, MASK_EXPERTS, WORDS)
    nan_sum = tl.zeros([row_off.shape[0], LANES], tl.float32)
    t0 = tl.zeros([row_off.shape[0], LANES], KEY)  # key 0: below every real expert (see _row_keys)
    t1 = t0
    t2 = t0
    t3 = t0
    t4 = t0
    t5 = t0
    t6 = t0
    t7 = t0
    best = (t0, t1, t2, t3, t4, t5, t6, t7)
    if TMA:
        TW: tl.constexpr = LANES * TILE * 4  # words of a tile's row (8 logits a chunk, two a word)
        row0 = tl.program_id(0) * row_off.shape[0]
        for i in tl.range(0, ITERS, num_stages=STAGES):
            chunks = _tile_chunks(logits_desc.load([row0, i * TW]), LANES, TILE, True)
            bias_chunks = _tile_chunks(bias_desc.load([0, i * (2 * TW)]), LANES, TILE)
            for g in tl.static_range(TILE):
                c = (i * TILE + g) * LANES + lane
                keys, nan_sum = _row_keys(chunks[g], chunks[g], bias_chunks[g], bias_chunks[g], num_experts,
                                          router_output_multiplier, base_bits, nan_sum, c, key_scale, 8, 8, False,
                                          INDEX_BITS, EXACT, HAS_MULTIPLIER, FAST_MATH, True)
                best = _keep_best8(best, _sort8(*keys))
    elif TILE > 0:  # tiles of TILE chunks a lane, loaded coalesced a tile ahead
        if WORDS:
            tbase = gating_output_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (row_off // 2)[:, None]
        else:
            tbase = gating_output_ptr + row_off[:, None]
        x = _load_tile(tbase, 0, num_experts, stride_gn, LANES, TILE, MASK_EXPERTS, WORDS)
        for i in range(ITERS):
            nx = _load_tile(tbase, tl.minimum(i + 1, ITERS - 1), num_experts, stride_gn, LANES, TILE, MASK_EXPERTS,
                            WORDS)
            chunks = _tile_chunks(x, LANES, TILE, WORDS)
            for g in tl.static_range(TILE):
                c = (i * TILE + g) * LANES + lane
                qlo, qhi = _load_chunk(bbase, bcol, c[:, :, None], num_experts, stride_bias, BIAS_VEC, MASK_EXPERTS)
                keys, nan_sum = _row_keys(chunks[g], chunks[g], qlo, qhi, num_experts, router_output_multiplier,
                                          base_bits, nan_sum, c, key_scale, 8, BIAS_VEC, MASK_EXPERTS, INDEX_BITS,
                                          EXACT, HAS_MULTIPLIER, FAST_MATH, WORDS)
                best = _keep_best8(best, _sort8(*keys))
            x = nx
    else:
        for i in range(0, ITERS, AHEAD):
            best, nan_sum, alo, ahi = _row_step(best, nan_sum, alo, ahi, i, gbase, col, bbase, bcol, lane, num_experts,
                                                stride_gn, stride_bias, router_output_multiplier, base_bits, key_scale,
                                                ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS, INDEX_BITS, EXACT,
                                                HAS_MULTIPLIER, FAST_MATH, AHEAD, WORDS)
            if AHEAD >= 2:
                best, nan_sum, blo, bhi = _row_step(best, nan_sum, blo, bhi, i + 1, gbase, col, bbase, bcol, lane,
                                                    num_experts, stride_gn, stride_bias, router_output_multiplier,
                                                    base_bits, key_scale, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                                                    INDEX_BITS, EXACT, HAS_MULTIPLIER, FAST_MATH, AHEAD, WORDS)
            if AHEAD >= 4:
                best, nan_sum, clo, chi = _row_step(best, nan_sum, clo, chi, i + 2, gbase, col, bbase, bcol, lane,
                                                    num_experts, stride_gn, stride_bias, router_output_multiplier,
                                                    base_bits, key_scale, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                                                    INDEX_BITS, EXACT, HAS_MULTIPLIER, FAST_MATH, AHEAD, WORDS)
                best, nan_sum, dlo, dhi = _row_step(best, nan_sum, dlo, dhi, i + 3, gbase, col, bbase, bcol, lane,
                                                    num_experts, stride_gn, stride_bias, router_output_multiplier,
                                                    base_bits, key_scale, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                                                    INDEX_BITS, EXACT, HAS_MULTIPLIER, FAST_MATH, AHEAD, WORDS)
    return tl.reduce(best, 1, _merge_lanes), tl.sum(nan_sum, axis=1)


@triton.jit
def _merge_lanes(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7):
    """Reduction step of :func:`_row_select`: the best 8 of two lanes' sorted lists."""
    return _keep_best8((a0, a1, a2, a3, a4, a5, a6, a7), (b0, b1, b2, b3, b4, b5, b6, b7))


@triton.jit
def _key_ids(keys, TOPK: tl.constexpr, INDEX_BITS: tl.constexpr):
    """The experts (a ``TOPK``-tuple of int32 tensors) of the best ``TOPK`` of :func:`_row_select`'s keys (window or
    exact: the expert is ``2**INDEX_BITS - 1`` less the low bits)."""
    MAXIDX: tl.constexpr = (1 << INDEX_BITS) - 1
    ids = ()
    for k in tl.static_range(TOPK):
        ids = ids + ((MAXIDX - (keys[k] & MAXIDX)).to(tl.int32),)
    return ids


@triton.jit
def _row_tile(
    gating_output_ptr, bias_ptr, row, num_tokens, num_experts, stride_gm, stride_gn, stride_bias,
    router_output_multiplier, base_bits, nan_bias,
    TOPK: tl.constexpr, ITERS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, BIAS_VEC: tl.constexpr,
    MASK_EXPERTS: tl.constexpr, INDEX_BITS: tl.constexpr, HAS_MULTIPLIER: tl.constexpr, FAST_MATH: tl.constexpr,
    AHEAD: tl.constexpr, TILE: tl.constexpr, WORDS: tl.constexpr, logits_desc, bias_desc, TMA: tl.constexpr,
    STAGES: tl.constexpr, REDO_OWN: tl.constexpr = False,
):
    """The picks of a tile's rows ``row`` (``(BLOCK_T,)`` int32, past ``num_tokens`` read as the last row, or with
    ``TMA`` as zeros): their ids and raw logits, re-read (in cache; ``TOPK``-tuples of ``(BLOCK_T,)`` tensors).
    The redo reads through pointers (``TMA`` or not: the same keys); ``REDO_OWN``: each thread's own 16-byte loads,
    one chunk at a time (the fewest registers; exact keys pick the same experts whatever the loads)."""
    row_off = tl.minimum(row, num_tokens - 1).to(tl.int64) * stride_gm
    keys, nan_sum = _row_select(gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias,
                                router_output_multiplier, base_bits, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                                INDEX_BITS, False, HAS_MULTIPLIER, FAST_MATH, AHEAD, TILE, WORDS, logits_desc,
                                bias_desc, TMA, STAGES)
    # Unproven: a pick clamped to the window's bottom (value bits 0: it may tie with unseen experts there), a NaN
    # logit (its unguarded score is NaN) or a NaN bias anywhere; rows past the last do not vote (whatever they read).
    flag = ((((keys[TOPK - 1] >> INDEX_BITS) == 0) | (nan_sum != nan_sum)) & (row < num_tokens)).to(tl.int32)
    # (a maximum over every thread of the program: one warp's REDUX where a program is one warp, not a tree of
    # shuffles)
    unproven = tl.max(tl.broadcast_to(flag[:, None], (flag.shape[0], LANES)), axis=None) + nan_bias
    ids = _key_ids(keys, TOPK, INDEX_BITS)
    # the picks' logits asked for before the vote, which then hides part of their latency (read again after a redo)
    x = _row_gather(gating_output_ptr, row_off, ids, stride_gn, TOPK)
    if unproven > 0:
        # REDO_OWN: ITERS * TILE chunks a thread, one at a time, as the tiles cover them (the same experts masked)
        R_ITERS: tl.constexpr = ITERS * max(TILE, 1) if REDO_OWN else ITERS
        R_AHEAD: tl.constexpr = 1 if REDO_OWN else AHEAD
        R_TILE: tl.constexpr = 0 if REDO_OWN else TILE
        exact, _ = _row_select(gating_output_ptr, bias_ptr, row_off, num_experts, stride_gn, stride_bias,
                               router_output_multiplier, base_bits, R_ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                               INDEX_BITS, True, HAS_MULTIPLIER, FAST_MATH, R_AHEAD, R_TILE, WORDS)
        ids = _key_ids(exact, TOPK, INDEX_BITS)
        x = _row_gather(gating_output_ptr, row_off, ids, stride_gn, TOPK)
    return ids, x


@triton.jit
def _row_gather(gating_output_ptr, row_off, ids, stride_gn, TOPK: tl.constexpr):
    """The raw logits of the experts ``ids`` (a ``TOPK``-tuple) of rows ``row_off`` (in cache: just read)."""
    x = ()
    for k in tl.static_range(TOPK):
        x = x + (tl.load(gating_output_ptr + row_off + ids[k] * stride_gn),)
    return x


@triton.jit
def _row_scores(x, row_ok, router_output_multiplier, TOPK: tl.constexpr, HAS_MULTIPLIER: tl.constexpr,
                FAST_MATH: tl.constexpr):
    """The unbiased scores (a ``TOPK``-tuple) of :func:`_row_tile`'s picked logits ``x``; 0 past the last row:
    :func:`_picked_scores`'s arithmetic."""
    scores = ()
    for k in tl.static_range(TOPK):
        scores = scores + (_logit_scores(x[k], row_ok, router_output_multiplier, 0.0, False, 1.0, 0, HAS_MULTIPLIER,
                                         FAST_MATH),)
    return scores


@triton.jit
def _row_store(
    ids, scores, row, row_ok,
    topk_weights_ptr, topk_ids_ptr, is_padding_ptr,
    stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
    route_scale, division_eps,
    TOPK: tl.constexpr, HAS_EPS: tl.constexpr, PICK_BITS: tl.constexpr,
):
    """Weights from the picks' scores, padding, and the stores: the arithmetic of
    :func:`routetool_kernels.routing_jit._write_outputs`, one ``(BLOCK_T,)`` tensor per output slot."""
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
    logits_desc,  # TMA: a tensor descriptor of the logits as int32 words (see _row_select); else None
    bias_desc,  # TMA: a tensor descriptor of the bias as (1, num_experts); else None
    TOPK: tl.constexpr,  # <= 8
    BLOCK_T: tl.constexpr,  # tokens per program: 32 * num_warps / LANES
    ITERS: tl.constexpr,  # loop iterations: cdiv(cdiv(num_experts, 8), LANES * max(TILE, 1))
    LANES: tl.constexpr,  # threads per token (power of two)
    VEC: tl.constexpr,  # logits per 16-byte load: 4 (fp32) or 8
    BIAS_VEC: tl.constexpr,  # bias values per 16-byte load
    MASK_EXPERTS: tl.constexpr,  # num_experts < ITERS * LANES * max(TILE, 1) * 8
    INDEX_BITS: tl.constexpr,  # bits of the largest expert index (<= 8)
    E_POW2: tl.constexpr,  # next power of two >= num_experts
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_MATH: tl.constexpr,
    PICK_BITS: tl.constexpr,  # sum of the picked scores: routetool_kernels.routing_policy.sum_bits(topk)
    AHEAD: tl.constexpr = 1,  # chunks a lane loads ahead: 1, 2 or 4, dividing ITERS
    TILE: tl.constexpr = 0,  # chunks a lane takes from each coalesced tile (0: 16-byte loads of its own)
    WORDS: tl.constexpr = False,  # bf16 logits read as int32 words of two (unit stride, even row stride)
    TMA: tl.constexpr = False,  # tiles copied into shared memory by the tensor-memory accelerator (_row_select)
    STAGES: tl.constexpr = 1,  # TMA: tiles in flight
    REDO_OWN: tl.constexpr = False,  # the redo through each thread's own loads, one chunk at a time (_row_tile)
):
    """Rows algorithm (sigmoid scores only). Grid ``(cdiv(num_tokens, BLOCK_T),)``: program ``p`` routes
    tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``, ``LANES`` threads a token (see the module docstring)."""
    # (each loop step takes AHEAD whole chunks: another AHEAD would skip or overrun chunks)
    tl.static_assert((AHEAD == 1 or AHEAD == 2 or AHEAD == 4) and ITERS % AHEAD == 0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    base_bits, nan_bias = _window_base(bias_ptr, num_experts, stride_bias, INDEX_BITS, E_POW2, FAST_MATH)
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < num_tokens
    ids, x = _row_tile(gating_output_ptr, bias_ptr, row, num_tokens, num_experts, stride_gm, stride_gn, stride_bias,
                       router_output_multiplier, base_bits, nan_bias, TOPK, ITERS, LANES, VEC, BIAS_VEC, MASK_EXPERTS,
                       INDEX_BITS, HAS_MULTIPLIER, FAST_MATH, AHEAD, TILE, WORDS, logits_desc, bias_desc, TMA, STAGES,
                       REDO_OWN)
    _row_store(ids, _row_scores(x, row_ok, router_output_multiplier, TOPK, HAS_MULTIPLIER, FAST_MATH), row, row_ok,
               topk_weights_ptr, topk_ids_ptr, is_padding_ptr, stride_wm, stride_wk, stride_im, stride_ik, stride_pad,
               route_scale, division_eps, TOPK, HAS_EPS, PICK_BITS)
