"""The project's MuseSpark1x routing kernel: several tokens per program, integer selection keys.

Algorithm, per program (``BLOCK_T`` tokens):

1. Load a ``[BLOCK_T, NUM_CHUNKS, CHUNK]`` tile of logits: each token row cut into
   ``NUM_CHUNKS`` runs of ``CHUNK`` contiguous experts (experts padded to a power of two).
   The innermost axis is the contiguous one, so loads are coalesced; the compiler lays
   threads out along it first and then along the rows, so ``CHUNK / vector width`` threads
   share a row. The default launch uses 32 (a whole warp per row), which makes every
   reduction a single warp-wide ``REDUX`` on Hopper (measured fastest at every batch size;
   benchmarks/NOTES.md). Logits of any float dtype are upcast to float32.
2. Scores: sigmoid or stable softmax of ``logits * multiplier`` (NaN logits count as -inf).
3. One int32 key per expert: the order-preserving integer image of the float32 biased score
   (``score + bias``, NaN -> -inf, -0.0 -> +0.0). Each of the ``TOPK`` rounds takes the
   largest key, then the lowest expert index holding it (so ties go to the lowest index,
   exactly as ``tl.argmax`` breaks them), and masks that expert out. Two 32-bit reductions
   per round measured faster on an H200 than one reduction over packed int64
   (score, index) keys, which Hopper compares in several instructions
   (benchmarks/NOTES.md).
4. Weights: the picked experts' logits are re-read (already in cache) and only those
   ``TOPK`` scores are recomputed (cheaper than a score reduction per round, measured),
   renormalised by ``route_scale / (sum + eps)``; a zero denominator gives weights 0.
   Padded rows get id -1 and weight 0.

Semantics are the seed's (see :mod:`kernel.reference`, which defines them, including the
rule for non-finite input). Differences from the seed kernel, and why:

* float32, bfloat16 and float16 gating_output are accepted (upcast on load); the seed
  passes bf16/fp16 to ``tl.sigmoid``/``tl.exp`` and fails to compile for them.
* NaN logits, ``+inf`` under softmax and a zero denominator follow the reference's safe
  rule instead of producing NaN weights or arbitrary ids.
* a non-float32 or strided bias is read in place (no float32 copy is allocated), so the
  call stays allocation-free with caller-provided outputs.
* int64 ``topk_ids`` buffers are accepted as well as int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernel._launch import check_routing_args, pdl_supported

_EMPTY_KEY = tl.constexpr(-(2**31))  # below every real key: the image of -inf is -2**31 + 0x7FFFFF


_UNROLL_MAX_TOPK = tl.constexpr(32)


@triton.jit
def _select_round(key, ids, expert, slot, k, E_PAD: tl.constexpr):
    """One selection round: the largest key, the lowest expert holding it; mask it, record it."""
    best = tl.max(tl.max(key, axis=2), axis=1)[:, None, None]  # (BLOCK_T, 1, 1)
    first = tl.min(tl.min(tl.where(key == best, expert, E_PAD), axis=2), axis=1)[:, None, None]
    key = tl.where(expert == first, _EMPTY_KEY, key)
    ids = tl.where(slot == k, first, ids)
    return key, ids


@triton.jit
def _routing_kernel(
    gating_output_ptr,  # (T, E) fp32|bf16|fp16, any strides
    bias_ptr,  # (E,) fp32|bf16|fp16, stride stride_bias
    topk_weights_ptr,  # (T, K) fp32 view
    topk_ids_ptr,  # (T, K) int32|int64 view
    is_padding_ptr,  # (T,) bool, or None
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
):
    """Grid ``(cdiv(num_tokens, BLOCK_T),)``: program ``p`` routes tokens ``[p*BLOCK_T, (p+1)*BLOCK_T)``."""
    E_PAD: tl.constexpr = NUM_CHUNKS * CHUNK
    pid = tl.program_id(0)

    # 3-D tile [BLOCK_T, NUM_CHUNKS, CHUNK]; expert = chunk * CHUNK + lane.
    expert = tl.arange(0, NUM_CHUNKS)[None, :, None] * CHUNK + tl.arange(0, CHUNK)[None, None, :]
    row = pid * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    expert_ok = expert < num_experts
    row_ok = row < num_tokens
    row_off = row.to(tl.int64) * stride_gm

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    logits = tl.load(
        gating_output_ptr + row_off + expert * stride_gn,
        mask=expert_ok & row_ok,
        other=-float("inf"),
    ).to(tl.float32)
    # The bias is loaded through a pointer tile of the logits' shape so it gets their layout.
    bias_ptrs = tl.broadcast_to(bias_ptr + expert * stride_bias, [BLOCK_T, NUM_CHUNKS, CHUNK])
    bias = tl.load(bias_ptrs, mask=expert_ok, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

    if HAS_MULTIPLIER:
        logits = logits * router_output_multiplier
    logits = tl.where(logits != logits, -float("inf"), logits)
    if NORMALIZATION_MODE == 0:
        scores = tl.sigmoid(logits)
    else:
        row_max = tl.max(tl.max(logits, axis=2), axis=1)[:, None, None]  # (BLOCK_T, 1, 1)
        has_inf = row_max == float("inf")
        finite_max = tl.where((row_max > -float("inf")) & ~has_inf, row_max, 0.0)
        exp = tl.where(has_inf, (logits == float("inf")).to(tl.float32), tl.exp(logits - finite_max))
        total = tl.sum(tl.sum(exp, axis=2), axis=1)[:, None, None]
        scores = tl.where(total > 0, exp / tl.where(total > 0, total, 1.0), 0.0)

    biased = scores + bias
    biased = tl.where(biased != biased, -float("inf"), biased)
    biased = tl.where(biased == 0.0, 0.0, biased)  # -0.0 and +0.0 must tie
    bits = biased.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    # Selection: TOPK rounds of (max of the keys, lowest expert holding it, mask it out).
    # Outputs live in (BLOCK_T, 1, TOPK_PADDED) tensors derived from the tile's layout, so
    # the rounds need no layout conversion (no shared-memory round trip per round).
    slot = tl.arange(0, TOPK_PADDED)[None, None, :]
    ids = tl.zeros([BLOCK_T, 1, TOPK_PADDED], dtype=tl.int32)
    key = tl.where(expert_ok, ordered, _EMPTY_KEY)
    if TOPK <= _UNROLL_MAX_TOPK:
        for k in tl.static_range(TOPK):
            key, ids = _select_round(key, ids, expert, slot, k, E_PAD)
    else:  # a loop, not unrolled: unrolling hundreds of rounds takes minutes to compile
        for k in range(TOPK):
            key, ids = _select_round(key, ids, expert, slot, k, E_PAD)

    # Weights from the picked experts only: re-read their logits (in cache), recompute their scores.
    out_ok = row_ok & (slot < TOPK)
    picked = tl.load(gating_output_ptr + row_off + ids * stride_gn, mask=out_ok, other=-float("inf"))
    picked = picked.to(tl.float32)
    if HAS_MULTIPLIER:
        picked = picked * router_output_multiplier
    picked = tl.where(picked != picked, -float("inf"), picked)
    if NORMALIZATION_MODE == 0:
        picked_scores = tl.sigmoid(picked)
    else:
        e = tl.where(has_inf, (picked == float("inf")).to(tl.float32), tl.exp(picked - finite_max))
        picked_scores = tl.where(total > 0, e / tl.where(total > 0, total, 1.0), 0.0)
    picked_scores = tl.where(out_ok, picked_scores, 0.0)
    denom = tl.sum(picked_scores, axis=2)[:, :, None]
    if HAS_EPS:
        denom = denom + division_eps
    inv_sum_scaled = tl.where(denom > 0, route_scale / tl.where(denom > 0, denom, 1.0), 0.0)
    weights = picked_scores * inv_sum_scaled

    if is_padding_ptr is not None:
        padded = tl.load(is_padding_ptr + row * stride_pad, mask=row_ok, other=0) != 0  # (BLOCK_T, 1, 1)
        ids = tl.where(padded, -1, ids)
        weights = tl.where(padded, 0.0, weights)
    tl.store(topk_ids_ptr + row * stride_im + slot * stride_ik, ids, mask=out_ok)
    tl.store(topk_weights_ptr + row * stride_wm + slot * stride_wk, weights, mask=out_ok)


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of :func:`fused_musespark1x_routing`.

    Attributes:
        block_t: tokens per program (power of two).
        chunk: contiguous experts per innermost tile run (power of two, <= padded experts).
        num_warps: warps per program.
    """

    block_t: int
    chunk: int
    num_warps: int


def padded_num_experts(num_experts: int) -> int:
    """Next power of two >= ``num_experts``, at least 8 (the seed's padding)."""
    return 1 << max(3, (num_experts - 1).bit_length())


SMALL_BATCH = 1024
"""Up to this many tokens the launch favours latency (one token per program, 32 lanes a row)."""


def default_config(num_tokens: int, num_experts: int, gating_dtype: torch.dtype, device_type: str = "cuda") -> LaunchConfig:
    """Launch settings chosen by shape, from the sweeps in benchmarks/NOTES.md (H200).

    On a GPU, 32 lanes share a row (each holding ``16 / itemsize``-wide vectors), so every
    reduction of a selection round is a single warp-wide ``REDUX`` on Hopper:

    * small batches (<= :data:`SMALL_BATCH` tokens, decode): one token per program and one
      warp, for the shortest dependency chain;
    * large batches (prefill): 8 tokens per program over 4 warps.

    Under the Triton interpreter (CPU tensors) each program costs Python overhead, so
    programs take up to 128 rows instead.
    """
    e_pad = padded_num_experts(num_experts)
    vec = 16 // gating_dtype.itemsize
    if device_type != "cuda":
        return LaunchConfig(block_t=min(128, triton.next_power_of_2(max(1, num_tokens))), chunk=min(e_pad, 64),
                            num_warps=4)
    chunk = min(e_pad, 32 * vec)
    if num_tokens <= SMALL_BATCH:
        return LaunchConfig(block_t=1, chunk=chunk, num_warps=1)
    return LaunchConfig(block_t=8, chunk=chunk, num_warps=4)


def fused_musespark1x_routing(
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
    config: LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run MuseSpark1x's router in one kernel (drop-in for the seed's function).

    Passing both output buffers keeps the call allocation-free, so it can be captured in
    a CUDA graph.

    Args:
        gating_output: ``[num_tokens, num_experts]`` float32, bfloat16 or float16 logits,
            any strides.
        bias: ``[num_experts]`` float32/bfloat16/float16 selection bias, any stride.
        topk: experts per token, ``1 <= topk <= num_experts``.
        route_scale: factor on the renormalised weights (routed_scaling_factor), > 0.
        router_output_multiplier: optional factor on the logits before normalization.
        router_score_normalization: ``"sigmoid"`` or ``"softmax"``.
        router_score_division_eps: optional non-negative term added to the denominator.
        topk_weights: optional float32 output buffer, at least ``[num_tokens, topk]``.
        topk_ids: optional int32 or int64 output buffer, at least ``[num_tokens, topk]``.
        is_padding: optional ``[num_tokens]`` bool; padded rows get id -1 and weight 0.
        use_pdl: programmatic dependent launch; ``None`` uses it where supported (Hopper+).
        config: launch settings; ``None`` picks them with :func:`default_config`.

    Returns:
        ``(topk_weights, topk_ids)``: ``[num_tokens, topk]`` views (float32, and int32 or
        the given buffer's int dtype), best expert first.

    Raises:
        ValueError: bad arguments (see :func:`kernel._launch.check_routing_args`) or a
            launch config that does not fit the shape.
    """
    launch = check_routing_args(
        gating_output, bias, topk, route_scale, router_output_multiplier,
        router_score_normalization, router_score_division_eps, topk_weights, topk_ids, is_padding,
    )
    if launch.num_tokens == 0:
        return launch.topk_weights, launch.topk_ids
    e_pad = padded_num_experts(launch.num_experts)
    if config is None:
        config = default_config(launch.num_tokens, launch.num_experts, gating_output.dtype, gating_output.device.type)
    for name, value in (("block_t", config.block_t), ("chunk", config.chunk), ("num_warps", config.num_warps)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"launch config {name}={value} must be a power of two")
    if config.chunk > e_pad:
        raise ValueError(f"launch config chunk={config.chunk} exceeds the padded expert count {e_pad}")
    enable_pdl = pdl_supported(gating_output.device) if use_pdl is None else bool(use_pdl)
    weights, ids = launch.topk_weights, launch.topk_ids
    _routing_kernel[(triton.cdiv(launch.num_tokens, config.block_t),)](
        gating_output,
        bias,
        weights,
        ids,
        is_padding,
        launch.num_tokens,
        launch.num_experts,
        gating_output.stride(0),
        gating_output.stride(1),
        bias.stride(0),
        weights.stride(0),
        weights.stride(1),
        ids.stride(0),
        ids.stride(1),
        is_padding.stride(0) if is_padding is not None else 0,
        launch.router_output_multiplier if launch.router_output_multiplier is not None else 1.0,
        launch.route_scale,
        launch.router_score_division_eps if launch.router_score_division_eps is not None else 0.0,
        TOPK=launch.topk,
        TOPK_PADDED=triton.next_power_of_2(launch.topk),
        NUM_CHUNKS=e_pad // config.chunk,
        CHUNK=config.chunk,
        BLOCK_T=config.block_t,
        NORMALIZATION_MODE=launch.normalization_mode,
        HAS_MULTIPLIER=launch.router_output_multiplier is not None,
        HAS_EPS=launch.router_score_division_eps is not None,
        USE_PDL=enable_pdl,
        num_warps=config.num_warps,
        **({"launch_pdl": True} if enable_pdl else {}),
    )
    return weights, ids
