"""Argument checks and output allocation shared by every MuseSpark1x routing launcher.

Every launcher in this package takes the seed's signature
(``fused_musespark1x_routing(gating_output, bias, topk, route_scale, ...)``) and calls
:func:`check_routing_args` for every call of a new argument signature (later calls with the
signature reuse the verdict: :mod:`routetool_kernels._dispatch`), so that wrong input raises the same
``ValueError`` whichever variant runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NORMALIZATION_MODES = {"sigmoid": 0, "softmax": 1}
"""``router_score_normalization`` name -> the constexpr mode the kernels take."""

GATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class RoutingLaunch:
    """Validated arguments of one routing call.

    ``topk_weights`` / ``topk_ids`` are the ``[num_tokens, topk]`` views the kernel writes
    (views into caller buffers when given, fresh tensors otherwise).
    """

    num_tokens: int
    num_experts: int
    topk: int
    normalization_mode: int
    route_scale: float
    router_output_multiplier: float | None
    router_score_division_eps: float | None
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def _finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a Python float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_routing_args(
    gating_output: torch.Tensor,
    bias: torch.Tensor,
    topk: int,
    route_scale: float,
    router_output_multiplier: float | None,
    router_score_normalization: str,
    router_score_division_eps: float | None,
    topk_weights: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    is_padding: torch.Tensor | None,
    gating_dtypes: tuple[torch.dtype, ...] = GATING_DTYPES,
    gating_dtype_reason: str = "",
    normalizations: tuple[str, ...] = tuple(NORMALIZATION_MODES),
) -> RoutingLaunch:
    """Validate a routing call and allocate the outputs that were not given.

    Raises:
        ValueError: naming the argument and what is wrong with it: rank, dtype, device or
            size of a tensor; ``topk`` outside ``[1, num_experts]``; an unknown
            normalization; a non-finite or non-positive ``route_scale``; a non-finite
            multiplier; a negative or non-finite eps; an output buffer that is too small
            or of the wrong dtype. The normalizations a kernel knows are those of
            :data:`NORMALIZATION_MODES` (``normalizations``: the reference's wider set; a mode
            the kernels lack is -1 in the launch).
    """
    if not isinstance(gating_output, torch.Tensor) or gating_output.dim() != 2:
        shape = tuple(gating_output.shape) if isinstance(gating_output, torch.Tensor) else type(gating_output).__name__
        raise ValueError(f"gating_output must be a 2-D tensor [num_tokens, num_experts], got {shape}")
    if gating_output.dtype not in gating_dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in gating_dtypes)
        raise ValueError(
            f"gating_output dtype {str(gating_output.dtype).removeprefix('torch.')} is not supported "
            f"(expected one of {names}){gating_dtype_reason}"
        )
    num_tokens, num_experts = gating_output.shape
    device = gating_output.device
    if num_experts < 1:
        raise ValueError("gating_output has 0 experts (columns); it needs at least 1")
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != num_experts:
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a 1-D tensor of num_experts={num_experts} values, got {shape}")
    if bias.dtype not in BIAS_DTYPES:
        raise ValueError(f"bias dtype {bias.dtype} is not supported (expected float32, bfloat16 or float16)")
    if bias.device != device:
        raise ValueError(f"bias is on {bias.device} but gating_output is on {device}")
    if isinstance(topk, bool) or not isinstance(topk, int):
        raise ValueError(f"topk must be an int, got {type(topk).__name__}")
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} is outside [1, num_experts={num_experts}]")
    if router_score_normalization not in normalizations:
        raise ValueError(
            f"unknown router_score_normalization {router_score_normalization!r}; "
            f"expected {' or '.join(repr(n) for n in normalizations)}"
        )
    route_scale = _finite_float("route_scale", route_scale)
    if route_scale <= 0.0:
        raise ValueError(f"route_scale must be > 0, got {route_scale}")
    if router_output_multiplier is not None:
        router_output_multiplier = _finite_float("router_output_multiplier", router_output_multiplier)
    if router_score_division_eps is not None:
        router_score_division_eps = _finite_float("router_score_division_eps", router_score_division_eps)
        if router_score_division_eps < 0.0:
            raise ValueError(f"router_score_division_eps must be >= 0, got {router_score_division_eps}")
    if is_padding is not None:
        if not isinstance(is_padding, torch.Tensor) or is_padding.dtype != torch.bool:
            raise ValueError("is_padding must be a torch.bool tensor")
        if tuple(is_padding.shape) != (num_tokens,):
            raise ValueError(f"is_padding must have shape ({num_tokens},), got {tuple(is_padding.shape)}")
        if is_padding.device != device:
            raise ValueError(f"is_padding is on {is_padding.device} but gating_output is on {device}")

    if topk_weights is None:
        topk_weights = torch.empty((num_tokens, topk), dtype=torch.float32, device=device)
    if topk_ids is None:
        topk_ids = torch.empty((num_tokens, topk), dtype=torch.int32, device=device)
    for name, buf, dtypes in (
        ("topk_weights", topk_weights, (torch.float32,)),
        ("topk_ids", topk_ids, ID_DTYPES),
    ):
        if not isinstance(buf, torch.Tensor) or buf.dim() != 2:
            raise ValueError(f"{name} buffer must be a 2-D tensor")
        if buf.dtype not in dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} buffer has dtype {str(buf.dtype).removeprefix('torch.')}; expected {names}")
        if buf.shape[0] < num_tokens or buf.shape[1] < topk:
            raise ValueError(
                f"{name} buffer of shape {tuple(buf.shape)} is too small for "
                f"[num_tokens={num_tokens}, topk={topk}]"
            )
        if buf.device != device:
            raise ValueError(f"{name} buffer is on {buf.device} but gating_output is on {device}")
    return RoutingLaunch(
        num_tokens=num_tokens,
        num_experts=num_experts,
        topk=topk,
        normalization_mode=NORMALIZATION_MODES.get(router_score_normalization, -1),
        route_scale=route_scale,
        router_output_multiplier=router_output_multiplier,
        router_score_division_eps=router_score_division_eps,
        topk_weights=topk_weights[:num_tokens, :topk],
        topk_ids=topk_ids[:num_tokens, :topk],
    )


def pdl_supported(device: torch.device) -> bool:
    """True when programmatic dependent launch can be used on ``device``.

    PDL (``griddepcontrol``) needs an NVIDIA GPU of compute capability 9.0 (Hopper) or
    newer; it is never used under the Triton interpreter or on ROCm.
    """
    return _hopper_or_newer(device)


def tma_supported(device: torch.device) -> bool:
    """True when kernels on ``device`` may copy tiles with the tensor-memory accelerator (TMA, Triton tensor
    descriptors): an NVIDIA GPU of compute capability 9.0 (Hopper) or newer (the Triton interpreter runs them too)."""
    return _hopper_or_newer(device)


def _hopper_or_newer(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9
