"""The tiled variant's launcher: :func:`fused_musespark1x_routing` and its plans.

The variant lives in three modules, one layer each:

* :mod:`routetool_kernels.routing_jit`: the ``@triton.jit`` code, the scan, two-level and rows algorithms
  (sketched in its docstring);
* :mod:`routetool_kernels.routing_policy`: the launch settings, chosen on the host by shape
  (``LaunchConfig``, ``default_config`` and the switches they read);
* this module: the launcher, which checks a call, takes its settings from the policy, and
  launches the kernel (:mod:`routetool_kernels._dispatch`).

The launcher reads every switch of :mod:`routetool_kernels.routing_policy` there, at each checked
call, so that is where a switch is set (then call :func:`routetool_kernels._dispatch.clear_plans`).

Semantics are the seed's (see :mod:`routetool_kernels.reference`, which defines them, including the
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

import copy

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from routetool_kernels import routing_policy as policy
from routetool_kernels._dispatch import ROUTING_PER_CALL, KernelLaunch, PlanCache, cached_call, is_interpreted, plan_for
from routetool_kernels._launch import check_routing_args, pdl_supported, tma_supported
from routetool_kernels.routing_jit import _routing_kernel, _rows_kernel, _two_level_kernel

_INTERPRETED = is_interpreted(_routing_kernel)

_PLANS = PlanCache()


def _row_words(gating_output: torch.Tensor) -> bool:
    """Whether the rows kernel reads bf16 logits as int32 words of two: unit expert stride, an even row stride and
    expert count, a 16-byte aligned start (what a plan's key records of the pointer: a plan made for one pointer
    serves every pointer of its key)."""
    return bool(policy.ROWS_WORDS and gating_output.dtype == torch.bfloat16
                and gating_output.stride(1) == 1 and gating_output.stride(0) % 2 == 0
                and gating_output.shape[1] % 2 == 0 and gating_output.data_ptr() % 16 == 0)


def _row_tma(gating_output: torch.Tensor, bias: torch.Tensor, num_tokens: int, lanes: int) -> bool:
    """Whether the rows kernel copies its tiles with the tensor-memory accelerator
    (:data:`routetool_kernels.routing_policy.ROWS_TMA_FROM`): more than that many tokens, bf16 logits read as words
    (:func:`_row_words`) in rows of whole 16-byte pieces, an expert count of whole tiles (``lanes * ROWS_TMA_TILE * 8``), a contiguous 16-byte aligned
    bias, and a device with TMA (or the interpreter). All of it is in a plan's key."""
    num_experts = gating_output.shape[1]
    return bool(policy.ROWS_TMA_FROM and num_tokens > policy.ROWS_TMA_FROM and _row_words(gating_output)
                and gating_output.stride(0) % 8 == 0 and num_experts % (lanes * policy.ROWS_TMA_TILE * 8) == 0
                and bias.stride(0) == 1 and bias.data_ptr() % 16 == 0 and num_experts * bias.element_size() % 16 == 0
                and (_INTERPRETED or tma_supported(gating_output.device)))


def row_descriptors(gating_output: torch.Tensor, bias: torch.Tensor, blocks: tuple) -> tuple:
    """The rows kernel's TMA tensor descriptors of a call: the logits as int32 words and the bias as ``(1, E)``,
    in blocks ``blocks`` (``(logits block, bias block)``, as :func:`fused_musespark1x_routing` chose them)."""
    return (TensorDescriptor.from_tensor(gating_output.view(torch.int32), list(blocks[0])),
            TensorDescriptor.from_tensor(bias.view(1, -1), list(blocks[1])))


class _Address:
    """A tensor's address and dtype: what a launch of a compiled kernel reads of a tensor descriptor's base (so
    that a kept descriptor holds no tensor)."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self._ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self._ptr


class RowDescriptors:
    """A plan's TMA tensor descriptors (:func:`row_descriptors`), kept by the logits' and the bias's addresses.

    The plan's key fixes every shape and stride, so a descriptor differs between its calls only by address: a
    direct launch takes the kept pair for its addresses (the bias, a model's parameter, keeps one; the logits as many
    as the caller's buffers, up to :attr:`KEEP`), so that a call builds none. The kept ones hold addresses, not
    tensors: of a descriptor, the launch of a compiled kernel reads its base's ``data_ptr()``, its shape, strides
    and padding (Triton 3.6-3.9, ``make_tensordesc_arg`` of its NVIDIA driver), and encodes the TMA descriptor
    from them. JIT launches (the interpreter, pre-run hooks) take new descriptors of the call's tensors.
    """

    KEEP = 16

    def __init__(self, blocks: tuple, gating_output: torch.Tensor, bias: torch.Tensor):
        self.blocks = blocks
        self._templates = row_descriptors(gating_output, bias, blocks)
        self._dtypes = tuple(d.base.dtype for d in self._templates)
        for d in self._templates:
            d.base = None  # (the first call's tensors are not kept)
        self._kept: dict[tuple[int, int], tuple] = {}

    def jit(self, gating_output: torch.Tensor, bias: torch.Tensor) -> tuple:
        return row_descriptors(gating_output, bias, self.blocks)

    def direct(self, gating_output: torch.Tensor, bias: torch.Tensor) -> tuple:
        key = (gating_output.data_ptr(), bias.data_ptr())
        pair = self._kept.get(key)
        if pair is None:
            if len(self._kept) >= self.KEEP:
                self._kept.clear()
            pair = tuple(self._rebased(d, p, t) for d, p, t in zip(self._templates, key, self._dtypes))
            self._kept[key] = pair
        return pair

    @staticmethod
    def _rebased(template: TensorDescriptor, ptr: int, dtype: torch.dtype) -> TensorDescriptor:
        d = copy.copy(template)  # (no __post_init__: the template's checks hold for every address of the key)
        d.base = _Address(ptr, dtype)
        return d


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
    config: policy.LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run MuseSpark1x's router in one kernel (drop-in for the seed's function).

    Passing both output buffers keeps the call allocation-free, so it can be captured in
    a CUDA graph.

    Semantics not implemented (docs/semantics.md), rejected before any launch: group-limited
    routing (``n_group``/``topk_group``/``topk_method``) and unrenormalised weights (``norm_topk_prob``), keywords
    this signature does not take (``TypeError``); the scoring functions ``sqrtsoftplus`` and
    ``topk_then_softmax`` (``ValueError``, unknown ``router_score_normalization``).

    The first call with an argument signature (every tensor's class, dtype, shape, strides,
    device and 16-byte alignment, every other argument's type and value, the current device)
    checks the arguments, picks the launch settings and launches through Triton's JIT; later
    calls with that signature reuse the verdict and the settings and launch the compiled
    kernel directly (:mod:`routetool_kernels._dispatch`), for a host cost close to an empty Triton
    launch's. After changing a switch of :mod:`routetool_kernels.routing_policy` (e.g.
    :data:`~routetool_kernels.routing_policy.DYNAMIC_TILES_FROM`), call :func:`routetool_kernels._dispatch.clear_plans`.

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
        config: launch settings; ``None`` picks them with
            :func:`routetool_kernels.routing_policy.default_config`.

    Returns:
        ``(topk_weights, topk_ids)``: ``[num_tokens, topk]`` views (float32, and int32 or
        the given buffer's int dtype), best expert first.

    Raises:
        ValueError: bad arguments (see :func:`routetool_kernels._launch.check_routing_args`) or a
            launch config that does not fit the shape.
        TypeError: a keyword beyond the seed's signature (``n_group``, ``norm_topk_prob``).
    """
    tensors = (gating_output, bias, topk_weights, topk_ids, is_padding)
    outputs, key = cached_call(_PLANS, tensors, (topk, route_scale, router_output_multiplier, router_score_normalization,
                                                 router_score_division_eps, use_pdl,
                                                 None if config is None else config._signature), not _INTERPRETED)
    if outputs is not None:
        return outputs
    launch = check_routing_args(
        gating_output, bias, topk, route_scale, router_output_multiplier,
        router_score_normalization, router_score_division_eps, topk_weights, topk_ids, is_padding,
    )
    e_pad = policy.padded_num_experts(launch.num_experts)
    if config is None:
        config = policy.default_config(launch.num_tokens, launch.num_experts, gating_output.dtype,
                                       gating_output.device.type, launch.topk,
                                       "softmax" if launch.normalization_mode == 1 else "sigmoid")
    policy.check_launch_config(config, launch.num_experts, launch.topk, softmax=launch.normalization_mode == 1)
    shape = (launch.num_tokens, launch.topk)
    if launch.num_tokens == 0:
        if key is not None:
            _PLANS.put(key, plan_for(shape, gating_output.device, topk_weights, topk_ids, None))
        return launch.topk_weights, launch.topk_ids
    enable_pdl = pdl_supported(gating_output.device) if use_pdl is None else bool(use_pdl)
    weights, ids = launch.topk_weights, launch.topk_ids
    num_tiles = triton.cdiv(launch.num_tokens, config.block_t)
    args = (
        None, None, None, None, None,  # the tensors of ROUTING_PER_CALL, given to the launch
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
    )
    common = dict(
        TOPK=launch.topk,
        BLOCK_T=config.block_t,
        HAS_MULTIPLIER=launch.router_output_multiplier is not None,
        HAS_EPS=launch.router_score_division_eps is not None,
        USE_PDL=enable_pdl,
        FAST_MATH=policy._fast_math(gating_output.device, _INTERPRETED),
        PICK_BITS=policy.sum_bits(launch.topk),
        num_warps=config.num_warps,
        **({"launch_pdl": True} if enable_pdl else {}),
        **({"maxnreg": config.max_registers} if config.max_registers and not _INTERPRETED else {}),
    )
    per_stream = None
    extra = ()
    cacheable = True
    tma_blocks = None
    if config.algorithm == "rows":
        lanes = config.chunk
        tma = _row_tma(gating_output, bias, launch.num_tokens, lanes)
        tile, ahead, iters = policy.rows_loads(launch.num_experts, gating_output.element_size(), lanes, tma)
        if tma:
            tma_blocks = ((config.block_t, lanes * tile * 4), (1, lanes * tile * 8))
            extra = row_descriptors(gating_output, bias, tma_blocks)
        kernel_launch = KernelLaunch(
            _rows_kernel, (num_tiles,), args,
            dict(ITERS=iters, LANES=lanes, VEC=16 // gating_output.element_size(), BIAS_VEC=16 // bias.element_size(),
                 MASK_EXPERTS=iters * lanes * max(tile, 1) * 8 != launch.num_experts, TILE=tile,
                 INDEX_BITS=policy.rows_index_bits(launch.num_experts),
                 E_POW2=triton.next_power_of_2(launch.num_experts), AHEAD=ahead,
                 WORDS=_row_words(gating_output), logits_desc=None, bias_desc=None, TMA=tma,
                 STAGES=policy.ROWS_TMA_STAGES if tma else 1, REDO_OWN=bool(policy.ROWS_REDO_OWN_LOADS), **common),
            ROUTING_PER_CALL + (("logits_desc", "bias_desc") if tma else ()))
    else:
        common.update(NORMALIZATION_MODE=launch.normalization_mode, TOTAL_BITS=policy.sum_bits(e_pad))
    if config.algorithm == "scan":
        kernel_launch = KernelLaunch(
            _routing_kernel, (num_tiles,), args, dict(TOPK_PADDED=triton.next_power_of_2(launch.topk),
                                                      NUM_CHUNKS=e_pad // config.chunk, CHUNK=config.chunk, **common),
            ROUTING_PER_CALL)
    elif config.algorithm == "two_level":
        grid = num_tiles
        if config.programs_per_sm and gating_output.device.type == "cuda":
            grid = min(num_tiles, config.programs_per_sm * policy._sm_count(gating_output.device))
        num_slices = triton.cdiv(launch.num_experts, config.chunk)
        persistent = grid < num_tiles
        ping_pong = persistent and num_slices * config.block_t <= policy.PING_PONG_MAX_SLICES * config.num_warps
        dynamic = {}
        if config.dynamic_tiles and persistent and not _INTERPRETED and num_tiles >= policy.DYNAMIC_TILES_FROM * grid:
            counters = policy.tile_counters(gating_output.device,
                                            allocate=not torch.cuda.is_current_stream_capturing())
            if counters is None:  # (static tiles for this call only: the plan would keep them)
                cacheable = False
            else:
                dynamic = dict(DYNAMIC=True, TILE_GROUPS=policy.TILE_GROUPS)
                per_stream = policy._TILE_COUNTERS
                extra = (counters,)
        kernel_launch = KernelLaunch(
            _two_level_kernel, (grid,), (*args, triton.cdiv(num_tiles, grid)),
            dict(WIDTH=config.chunk, NUM_SLICES=num_slices, MASK_EXPERTS=num_slices * config.chunk != launch.num_experts,
                 PERSISTENT=persistent, PING_PONG=ping_pong, **dynamic, **common),
            ROUTING_PER_CALL + (("counter_ptr",) if extra else ()))
    kernel_launch.first(gating_output, bias, weights, ids, is_padding, *extra)
    if key is not None and cacheable:
        _PLANS.put(key, plan_for(shape, gating_output.device, topk_weights, topk_ids, kernel_launch,
                                 per_stream=per_stream,
                                 descriptors=tma_blocks and RowDescriptors(tma_blocks, gating_output, bias)))
    return weights, ids
