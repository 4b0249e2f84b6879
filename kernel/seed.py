"""The seed variant: MuseSpark1x routing with the seed kernel's algorithm, kept for comparison.

Algorithm (as in vLLM's ``fused_routing`` seed): one program per token loads the whole
row (experts padded to a power of two, at least 8), applies the multiplier, normalises
(sigmoid or stable softmax), adds the bias, then runs ``topk`` rounds of ``tl.argmax`` over
the experts not picked yet, summing the picked *unbiased* scores as it goes. The weights
are the picked scores times ``route_scale / (sum + eps)``; padded rows get -1 / 0.

This variant keeps the seed's arithmetic on every input, including its undefined cases
(NaN logits, a zero denominator), so that ``routetool validate`` can report how the seed
behaves there. For ``topk > 32`` its rounds run as a loop instead of being unrolled (the
same arithmetic; unrolling 384 or 512 rounds takes minutes to compile). It differs from the seed only in its launcher, which raises ``ValueError``
instead of asserting, and in rejecting float16/bfloat16 gating_output up front: the seed
hands them to ``tl.sigmoid`` / ``tl.exp``, which accept only fp32/fp64, so the seed fails
to compile for them on a GPU. Use :func:`routetool_kernels.routing.fused_musespark1x_routing` for
those dtypes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from routetool_kernels._dispatch import ROUTING_PER_CALL, KernelLaunch, PlanCache, cached_call, is_interpreted, plan_for
from routetool_kernels._launch import check_routing_args, pdl_supported


@triton.jit
def _seed_select_one(keys, scores, picked, in_range, experts, slots, k, ids, weights, total):
    """One round: argmax over the experts not picked yet; record it and its *unbiased* score."""
    candidates = tl.where(picked | ~in_range, -float("inf"), keys)
    best = tl.argmax(candidates, axis=0)
    hit = experts == best
    best_score = tl.sum(tl.where(hit, scores, 0.0), axis=0)
    ids = tl.where(slots == k, best.to(tl.int32), ids)
    weights = tl.where(slots == k, best_score, weights)
    return picked | hit, ids, weights, total + best_score


@triton.jit
def _seed_routing_kernel(
    gating_output_ptr,  # (T, E) fp32, strides (stride_gm, stride_gn)
    bias_ptr,  # (E,) fp32, contiguous (the launcher copies any other bias to one)
    topk_weights_ptr,  # (T, topk) fp32, strides (stride_wm, stride_wk)
    topk_ids_ptr,  # (T, topk) int32|int64, strides (stride_im, stride_ik); -1 for padded tokens
    is_padding_ptr,  # (T,) bool, stride stride_pad, or None (no padding)
    stride_pad,
    num_tokens,
    num_experts,
    stride_gm,
    stride_gn,
    stride_wm,
    stride_wk,
    stride_im,
    stride_ik,
    router_output_multiplier,
    route_scale,
    division_eps,
    TOPK: tl.constexpr,
    TOPK_PADDED: tl.constexpr,
    NUM_EXPERTS_PADDED: tl.constexpr,
    NORMALIZATION_MODE: tl.constexpr,  # 0 sigmoid, 1 softmax
    HAS_MULTIPLIER: tl.constexpr,
    HAS_EPS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid ``(num_tokens,)``: program ``t`` routes token ``t``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    token = tl.program_id(0)
    if token >= num_tokens:
        return

    experts = tl.arange(0, NUM_EXPERTS_PADDED)
    in_range = experts < num_experts
    logits = tl.load(
        gating_output_ptr + token * stride_gm + experts * stride_gn,
        mask=in_range,
        other=-float("inf"),
    )
    if HAS_MULTIPLIER:
        logits = logits * router_output_multiplier
    if NORMALIZATION_MODE == 0:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.where(in_range, logits, -float("inf")), axis=0)
        exp = tl.where(in_range, tl.exp(logits - row_max), 0.0)
        scores = exp / tl.sum(exp, axis=0)
    keys = scores + tl.load(bias_ptr + experts, mask=in_range, other=0.0)

    slots = tl.arange(0, TOPK_PADDED)
    picked = tl.zeros([NUM_EXPERTS_PADDED], dtype=tl.int1)
    ids = tl.zeros([TOPK_PADDED], dtype=tl.int32)
    weights = tl.zeros([TOPK_PADDED], dtype=tl.float32)
    total = 0.0
    if TOPK <= 32:
        for k in tl.static_range(TOPK):
            picked, ids, weights, total = _seed_select_one(keys, scores, picked, in_range, experts, slots, k, ids,
                                                           weights, total)
    else:  # same rounds in a loop: unrolling hundreds of them takes minutes to compile
        for k in range(TOPK):
            picked, ids, weights, total = _seed_select_one(keys, scores, picked, in_range, experts, slots, k, ids,
                                                           weights, total)

    if HAS_EPS:
        total = total + division_eps
    scale = route_scale / total
    if is_padding_ptr is not None:
        padded = tl.load(is_padding_ptr + token * stride_pad)
        ids = tl.where(padded, -1, ids)
        scale = tl.where(padded, 0.0, scale)
    out = slots < TOPK
    tl.store(topk_ids_ptr + token * stride_im + slots * stride_ik, ids, mask=out)
    tl.store(topk_weights_ptr + token * stride_wm + slots * stride_wk, weights * scale, mask=out)


_INTERPRETED = is_interpreted(_seed_routing_kernel)

_PLANS = PlanCache()


def fused_musespark1x_routing_seed(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    route_scale: float,
    router_output_multiplier: float | None = None,
    router_score_normalization: str = "sigmoid",
    router_score_division_eps: float | None = None,
    topk_weights: torch.Tensor | None = None,
    topk_ids: torch.Tensor | None = None,
    *,
    is_padding: torch.Tensor | None = None,
    use_pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route with the seed's algorithm (one program per token, repeated argmax).

    Checked and launched once per argument signature through Triton's JIT, then launched
    directly, like :func:`routetool_kernels.routing.fused_musespark1x_routing`.

    Semantics not implemented (docs/semantics.md), rejected before any launch: group-limited
    routing (``n_group``/``topk_group``/``topk_method``) and unrenormalised weights (``norm_topk_prob``), keywords
    this signature does not take (``TypeError``); the scoring functions ``sqrtsoftplus`` and
    ``topk_then_softmax`` (``ValueError``, unknown ``router_score_normalization``).

    Args:
        gating_output: ``[num_tokens, num_experts]`` **float32** logits, any strides.
        bias: ``[num_experts]`` float32/bfloat16/float16 selection bias (upcast to a new
            float32 tensor when it is not float32 or not contiguous, as the seed does).
        topk: experts per token, ``1 <= topk <= num_experts``.
        route_scale: factor on the renormalised weights, > 0.
        router_output_multiplier: optional factor on the logits.
        router_score_normalization: ``"sigmoid"`` or ``"softmax"``.
        router_score_division_eps: optional non-negative term added to the denominator.
        topk_weights: optional float32 output buffer, at least ``[num_tokens, topk]``.
        topk_ids: optional int32 or int64 output buffer, at least ``[num_tokens, topk]``.
        is_padding: optional ``[num_tokens]`` bool; padded rows get id -1 and weight 0.
        use_pdl: programmatic dependent launch; ``None`` uses it where supported (Hopper+).

    Returns:
        ``(topk_weights, topk_ids)`` views of shape ``[num_tokens, topk]``.

    Raises:
        ValueError: bad arguments (see :func:`routetool_kernels._launch.check_routing_args`), and
            bfloat16/float16 gating_output, which the seed cannot compile.
        TypeError: a keyword beyond the seed's signature (``n_group``, ``norm_topk_prob``).
    """
    tensors = (gating_output, bias, topk_weights, topk_ids, is_padding)
    outputs, key = cached_call(_PLANS, tensors, (topk, route_scale, router_output_multiplier, router_score_normalization,
                                                 router_score_division_eps, use_pdl), not _INTERPRETED)
    if outputs is not None:
        return outputs
    launch = check_routing_args(
        gating_output, bias, topk, route_scale, router_output_multiplier,
        router_score_normalization, router_score_division_eps, topk_weights, topk_ids,
        is_padding, gating_dtypes=(torch.float32,),
        gating_dtype_reason=": the seed kernel passes it to tl.sigmoid/tl.exp, which accept only fp32/fp64",
    )
    shape = (launch.num_tokens, launch.topk)
    if launch.num_tokens == 0:
        if key is not None:
            _PLANS.put(key, plan_for(shape, gating_output.device, topk_weights, topk_ids, None))
        return launch.topk_weights, launch.topk_ids
    bias_to_float32 = bias.dtype != torch.float32 or not bias.is_contiguous()
    if bias_to_float32:
        bias = bias.float().contiguous()
    enable_pdl = pdl_supported(gating_output.device) if use_pdl is None else bool(use_pdl)
    weights, ids = launch.topk_weights, launch.topk_ids
    kernel_launch = KernelLaunch(_seed_routing_kernel, (launch.num_tokens,), (
        None, None, None, None, None,  # the tensors of ROUTING_PER_CALL, given to the launch
        is_padding.stride(0) if is_padding is not None else 0,
        launch.num_tokens,
        launch.num_experts,
        gating_output.stride(0),
        gating_output.stride(1),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        launch.router_output_multiplier if launch.router_output_multiplier is not None else 1.0,
        launch.route_scale,
        launch.router_score_division_eps if launch.router_score_division_eps is not None else 0.0,
    ), dict(
        TOPK=launch.topk,
        TOPK_PADDED=triton.next_power_of_2(launch.topk),
        NUM_EXPERTS_PADDED=1 << max(3, (launch.num_experts - 1).bit_length()),
        NORMALIZATION_MODE=launch.normalization_mode,
        HAS_MULTIPLIER=launch.router_output_multiplier is not None,
        HAS_EPS=launch.router_score_division_eps is not None,
        USE_PDL=enable_pdl,
        num_warps=1 if launch.num_experts == 256 else 4,
        **({"launch_pdl": True} if enable_pdl else {}),
    ), ROUTING_PER_CALL)
    kernel_launch.first(gating_output, bias, weights, ids, is_padding)
    if key is not None:
        _PLANS.put(key, plan_for(shape, gating_output.device, topk_weights, topk_ids, kernel_launch,
                                 bias_to_float32=bias_to_float32))
    return weights, ids

