"""The kernel under test: one place that calls a routing kernel and judges the call.

Every command (replay, validate's suite and traces, balance, bench) calls kernels through
:func:`call_kernel`, and reads the judgement from the :class:`KernelOutcome` it returns: the
outputs, or a failure class with a one-line message. The classes, and the exit code each maps
to (:attr:`KernelOutcome.exit_code`, the same in every command):

* ``crash`` (1): the kernel raised something other than a rejection, ``SystemExit`` included;
* ``rejected_documented`` (2): it raised :data:`REJECTION_TYPES` on an input whose unusual
  feature its docstring names (the seed and bf16 logits, :func:`rejection_documented`): a
  documented restriction, so bad usage (choose another kernel or another input). Where the tool
  made the input itself (a suite case, a bench shape) the caller reports it as ``rejected``;
* ``rejected_undocumented`` (1): a rejection the docstring does not document (any rejection of
  float32 logits in an ordinary layout);
* ``modified_input`` (1): it wrote into ``gating_output``, ``bias`` or ``is_padding``;
* ``wrong_shape`` (1): it returned something other than two tensors of shape ``[n, topk]``;
* ``wrong_dtype`` (1): weights that are not float32, or ids that are not int32/int64;
* ``wrong_device`` (1): outputs on another device than ``gating_output``'s.

What the outputs hold (invalid ids, wrong weights) is judged by the comparison
(:mod:`routetool.engine.compare`), per chunk of steps, not here.

The input check copies the inputs before the call and compares bits after it, which
synchronises with the GPU: :class:`InputGuard` does it once for a chunk of many calls (the
streaming engine), ``check_inputs=True`` once for a single call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from routetool.errors import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    KernelError,
    KernelRejection,
    first_line,
    is_allocation_failure,
)

RoutingFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

REJECTION_TYPES = (ValueError, TypeError, NotImplementedError)
"""The exceptions by which a kernel rejects an input; whether it documents the rejection is
:func:`rejection_documented`'s question. Anything else a kernel raises is a crash."""

KERNEL_WEIGHT_DTYPE = torch.float32
KERNEL_ID_DTYPES = (torch.int32, torch.int64)
"""The dtypes of a routing kernel's outputs (the seed's and the project's): every command holds
every kernel to them (``wrong_dtype``)."""

CONTRACT_CLASSES = ("crash", "rejected_documented", "rejected_undocumented", "modified_input", "wrong_shape",
                    "wrong_dtype", "wrong_device")
"""The failure classes a call can end in (see the module docstring)."""


def rejection_documented(fn: RoutingFn, feature: str | None) -> bool:
    """Whether ``fn``'s docstring names ``feature`` (case-insensitive), i.e. documents it.

    ``feature`` is the unusual property of the rejected input (``"bfloat16"``, ``"int64"``,
    ``"non-contiguous"``); ``None`` for an input without one (float32 logits in ordinary
    layouts), whose rejection is never documented: every routing kernel must take it.
    """
    doc = (getattr(fn, "__doc__", None) or "").lower()
    return bool(feature) and feature.lower() in doc


def dtype_feature(dtype: torch.dtype) -> str | None:
    """The unusual feature of ``gating_output`` in ``dtype``, for :func:`rejection_documented`:
    its name for bfloat16 and float16 (``"bfloat16"``), None for float32, which every kernel must
    route (as validate's ``dtypes`` family has it)."""
    return None if dtype == torch.float32 else str(dtype).removeprefix("torch.")


@dataclass
class KernelOutcome:
    """What one call of a kernel under test gave.

    Attributes:
        weights / ids: the returned ``[n, topk]`` float32 weights and int32/int64 ids (None when
            the call failed).
        failure_class: one of :data:`CONTRACT_CLASSES`, or None for a call that kept the contract.
        detail: what happened, in a few words (the exception's first line, the inputs written
            into, the outputs returned).
        fix: what the kernel's author should do. expected: for wrong outputs, what was expected.
    """

    weights: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    failure_class: str | None = None
    detail: str = ""
    fix: str = ""
    expected: str = ""

    @property
    def ok(self) -> bool:
        return self.failure_class is None

    @property
    def exit_code(self) -> int:
        """0 for a kept contract; 2 for a documented rejection (bad usage); 1 for any other failure."""
        if self.failure_class is None:
            return EXIT_OK
        return EXIT_USAGE if self.failure_class == "rejected_documented" else EXIT_FINDINGS

    def message(self, name: str, where: str = "") -> str:
        """One line naming the kernel (``name``, as the command calls it: ``kernel 'k'``), where
        (``layer 0 step 3``; may be empty) and what happened, e.g. ``kernel 'k' crashed on layer 0
        step 3 (ZeroDivisionError: division by zero)``."""
        on = f" on {where}" if where else ""
        c, d = self.failure_class, self.detail
        if c == "crash":
            return f"{name} crashed{on} ({d})"
        if c in ("rejected_documented", "rejected_undocumented"):
            tail = ", a rejection its docstring does not document" if c == "rejected_undocumented" else ""
            return f"{name} rejected {where or 'the input'} ({d}){tail}"
        if c == "modified_input":
            return f"{name} wrote into its input {d}{on}"
        return f"{name} returned {d}{on}; {self.expected}" if self.expected else f"{name} returned {d}{on}"

    def error(self, name: str, where: str, *, path: object = None, tensor: str | None = None):
        """The :class:`~routetool.errors.RouteToolError` that stops a command on this failure:
        :class:`KernelRejection` (exit 2) for a documented rejection, :class:`KernelError` (exit 1)
        otherwise."""
        if self.failure_class == "rejected_documented":
            return KernelRejection(self.message(name, where), path=path, tensor=tensor, fix=self.fix)
        return KernelError(self.message(name, where), failure_class=self.failure_class, path=path, tensor=tensor,
                           fix=self.fix)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.dtype != torch.bool else t


class InputGuard:
    """Bit-exact copies of input tensors, to tell afterwards whether a kernel wrote into them.

    ``InputGuard(gating_output=g, bias=b, is_padding=p)`` copies the tensors (None skipped);
    :meth:`changed` compares bits (NaN equal to itself) and synchronises once.
    :meth:`first_changed_row` names the first changed row of a ``[n, ...]`` input.
    """

    def __init__(self, **inputs: torch.Tensor | None):
        self.inputs = {name: t for name, t in inputs.items() if t is not None}
        self.copies = {name: t.detach().clone() for name, t in self.inputs.items()}

    def changed(self) -> list[str]:
        """Names of the inputs whose bits differ from the copies."""
        return [name for name, t in self.inputs.items() if not torch.equal(_bits(self.copies[name]), _bits(t))]

    def first_changed_row(self, name: str) -> int:
        """The first row of input ``name`` whose bits differ from the copy (0 for a 0-d or 1-row one)."""
        a, b = _bits(self.copies[name]), _bits(self.inputs[name])
        if a.dim() == 0:
            return 0
        diff = (a != b).reshape(a.shape[0], -1).any(-1)
        return int(diff.to(torch.int8).argmax())


def call_kernel(fn: RoutingFn, gating_output: torch.Tensor, bias: torch.Tensor, *, params: Mapping[str, object],
                is_padding: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                topk_ids: torch.Tensor | None = None, feature: str | None = None,
                check_inputs: bool = True) -> KernelOutcome:
    """Call a routing kernel by the documented convention and judge the call.

    The convention (README, ``--kernel``): ``fn(gating_output, bias, topk_weights=...,
    topk_ids=..., is_padding=..., **params)``, logits and bias by position, the rest by keyword.

    Args:
        fn: the kernel under test.
        gating_output: ``[n, E]`` logits. bias: ``[E]`` float32. is_padding: ``[n]`` bool or None.
        params: the router parameters by keyword (:meth:`routetool_kernels.spec.RouterSpec.kernel_kwargs`:
            ``topk`` and the rest of :data:`routetool_kernels.spec.RouterSpec.KERNEL_KEYWORDS`).
        topk_weights / topk_ids: output buffers the kernel should write, or None (it allocates).
        feature: the input's unusual feature for :func:`rejection_documented` (default: the
            logits' dtype, :func:`dtype_feature`).
        check_inputs: copy the inputs and compare them after the call (one synchronisation);
            False when the caller guards them itself (:class:`InputGuard`) or inside a CUDA-graph
            capture.

    Returns:
        A :class:`KernelOutcome`; it never raises for what the kernel does, only
        ``KeyboardInterrupt`` and routetool's termination pass through.
    """
    guard = InputGuard(gating_output=gating_output, bias=bias, is_padding=is_padding) if check_inputs else None
    try:
        out = fn(gating_output, bias, topk_weights=topk_weights, topk_ids=topk_ids, is_padding=is_padding, **params)
    except REJECTION_TYPES as exc:
        feature = dtype_feature(gating_output.dtype) if feature is None else feature
        if rejection_documented(fn, feature):
            return KernelOutcome(failure_class="rejected_documented", detail=first_line(exc),
                                 fix="choose another --kernel, or an input the kernel supports")
        fix = (f"fix the kernel, or name {feature} in its docstring as unsupported" if feature
               else "fix the kernel: every routing kernel must route float32 logits")
        return KernelOutcome(failure_class="rejected_undocumented", detail=first_line(exc), fix=fix)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever the kernel under test raises is reported
        if is_allocation_failure(exc):  # (the input's size, not the kernel: exit 2 at the command)
            raise
        return KernelOutcome(failure_class="crash", detail=first_line(exc), fix="fix the kernel")
    if guard is not None:
        changed = guard.changed()
        if changed:
            return modified_outcome(changed)
    return judge_outputs(out, gating_output, int(params["topk"]))


def modified_outcome(changed: list[str]) -> KernelOutcome:
    """The outcome of a call that wrote into the inputs named in ``changed``."""
    return KernelOutcome(failure_class="modified_input", detail=", ".join(changed),
                         fix="a routing kernel may write only topk_weights and topk_ids")


def judge_outputs(out: object, gating_output: torch.Tensor, topk: int) -> KernelOutcome:
    """Judge what a kernel returned for ``gating_output`` ``[n, E]``: two tensors ``[n, topk]``,
    float32 weights and int32/int64 ids, on ``gating_output``'s device (host-side checks only: no
    synchronisation)."""
    n = int(gating_output.shape[0])
    pair = isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    expected = f"expected (topk_weights float32 [{n}, {topk}], topk_ids int32 or int64 [{n}, {topk}])"
    got = f"({_describe(out)})"
    if pair:
        w, ids = out
        if tuple(w.shape) == (n, topk) and tuple(ids.shape) == (n, topk):
            if w.dtype != KERNEL_WEIGHT_DTYPE or ids.dtype not in KERNEL_ID_DTYPES:
                return KernelOutcome(failure_class="wrong_dtype", detail=got, expected=expected,
                                     fix="return float32 topk_weights and int32/int64 topk_ids")
            device = gating_output.device
            if w.device != device or ids.device != device:
                return KernelOutcome(failure_class="wrong_device",
                                     detail=_elsewhere(device, topk_weights=w, topk_ids=ids),
                                     expected=f"its inputs are on device {device}",
                                     fix="return the outputs on the device of gating_output")
            return KernelOutcome(weights=w, ids=ids)
    return KernelOutcome(failure_class="wrong_shape", detail=got, expected=expected,
                         fix="return (topk_weights, topk_ids)")


def _describe(out: object) -> str:
    if not isinstance(out, (tuple, list)):
        return type(out).__name__
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor)
                     else type(t).__name__ for t in out)


def _elsewhere(device: torch.device, **outputs: torch.Tensor) -> str:
    """Which ``outputs`` lie on another device than ``device``, as text
    (``"topk_weights and topk_ids on device meta"``, ``"topk_ids on device cpu"``)."""
    wrong = {name: t.device for name, t in outputs.items() if t.device != device}
    if len(set(wrong.values())) == 1:
        return f"{' and '.join(wrong)} on device {next(iter(wrong.values()))}"
    return " and ".join(f"{name} on device {dev}" for name, dev in wrong.items())
