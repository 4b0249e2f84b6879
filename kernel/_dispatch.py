"""Cheap repeated routing calls: one plan per argument signature, and direct launches of compiled kernels.

What a launcher checks (:func:`routetool_kernels._launch.check_routing_args`, the launch config) and the
launch settings it picks depend only on a call's *signature*: the class, dtype, shape, strides
and device of every tensor argument, the 16-byte alignment of every data pointer, the type and
value of every other argument, and the current CUDA device. So a launcher builds that key on
every call (:func:`call_signature`, a few microseconds) and looks it up in a
:class:`PlanCache`. Only the first call with a key runs the checks (a bad call raises there, with
each check's own message, and leaves no plan), picks the launch settings and launches through
Triton's JIT, which binds and specialises the arguments, compiles and caches the kernel. The
plan it leaves holds a :class:`KernelLaunch`: the compiled kernel and every argument that the
key fixes. Later calls with the key fill in the data pointers and launch the compiled kernel
directly, the same call the JIT makes after its own dispatch (``compiled.run(grid, stream,
function, metadata, launch hooks, *args)``), without binding, specialising or looking anything
up again. The key holds everything that Triton specialises on (dtypes, the pointers' 16-byte
alignment, the integer arguments through the shapes and strides, the constexprs through the
parameters), so the compiled kernel is the one the JIT would pick for the call.

The direct launch falls back to the JIT call (the same arguments, one dispatch) under the
Triton interpreter (``TRITON_INTERPRET=1``), while the kernel has pre-run hooks, and on a Triton
whose compiled kernels lack what the direct launch needs. Launch hooks
(``triton.knobs.runtime.launch_enter_hook``, as profilers set) are called as the JIT calls them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

MAX_PLANS = 4096
"""Most plans a :class:`PlanCache` holds; one more empties it (a call is re-checked, never wrong)."""

_CACHES: list[PlanCache] = []


class PlanCache:
    """Plans of one launcher, by call signature (:func:`call_signature`). Bounded by :data:`MAX_PLANS`."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Any] = {}
        self.get = self._plans.get
        _CACHES.append(self)

    def put(self, key: tuple, plan: Any) -> None:
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def clear_plans() -> None:
    """Forget every launcher's plans, so that each next call is checked and configured afresh.

    Needed only after changing a module-level setting that launch settings are chosen from
    (e.g. :data:`routetool_kernels.routing_policy.DYNAMIC_TILES_FROM`, as experiments and tests do).
    """
    for cache in _CACHES:
        cache.clear()


class _Driver:
    """Triton's current-device and current-stream functions, looked up once (the ones its JIT calls)."""

    current_device = None
    current_stream = None
    runtime_knobs = None

    @classmethod
    def load(cls) -> bool:
        if cls.current_device is None:
            import triton
            from triton.runtime import driver

            cls.runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
            active = driver.active
            cls.current_device = active.get_current_device
            cls.current_stream = active.get_current_stream
        return cls.runtime_knobs is not None


def is_interpreted(fn) -> bool:
    """Whether ``fn`` (a ``@triton.jit`` function) runs under the Triton interpreter."""
    return type(fn).__name__ == "InterpretedFunction"


def call_signature(tensors: tuple, others: tuple, compiled: bool) -> tuple[tuple, list, int | None]:
    """The plan key of a launcher call, its data pointers and the current device.

    Args:
        tensors: the call's tensor arguments, each a ``torch.Tensor`` or ``None``.
        others: every other argument (ints, floats, strings, ``None``, hashable config keys).
        compiled: kernels are compiled (not interpreted): the current CUDA device is part of
            the key, since the JIT keeps a compiled kernel per device.

    Returns:
        ``(key, pointers, device)``: ``key`` holds, per tensor, its class, dtype, shape, strides,
        device and whether its data pointer is 16-byte aligned (``None`` for ``None``), and per
        other argument its class and value (so ``True``, ``1`` and ``1.0`` differ); ``pointers``
        the tensors' ``data_ptr()`` (``None`` for ``None``); ``device`` the current device index
        (``None`` when interpreted).

    Raises:
        AttributeError, TypeError, RuntimeError: an argument that is no tensor where one is
            expected, or no CUDA device; the launcher then takes its checked path, whose checks
            name the mistake.
    """
    parts: list = []
    pointers: list = []
    for t in tensors:
        if t is None:
            parts.append(None)
            pointers.append(None)
        else:
            p = t.data_ptr()
            parts.append((t.__class__, t.dtype, t.shape, t.stride(), t.device, p & 15 == 0))
            pointers.append(p)
    for v in others:
        parts.append(v.__class__)
        parts.append(v)
    device = None
    if compiled:
        if _Driver.current_device is None:
            _Driver.load()
        device = _Driver.current_device()
    parts.append(device)
    return tuple(parts), pointers, device


class KernelLaunch:
    """One launch of a ``@triton.jit`` kernel with everything but some pointer arguments fixed.

    Built from the arguments of a JIT call (``fn[grid](*args, **kwargs)``), with the names of
    the parameters that change from call to call (``per_call``: tensors, or ``None`` for a
    ``None`` argument). :meth:`first` makes that JIT call and keeps the compiled kernel it
    returns; :meth:`direct` then launches it with new data pointers (ints, in ``per_call``
    order) on a given stream, and :meth:`jit` makes the JIT call again with new tensors (the
    fallback: interpreter, pre-run hooks).

    Attributes:
        can_direct: :meth:`direct` may be used (compiled kernel kept, no pre-run hooks).
    """

    def __init__(self, fn, grid: tuple[int, ...], args: tuple, kwargs: dict, per_call: tuple[str, ...]):
        sig = getattr(fn, "signature", None) or inspect.signature(fn.fn)
        params = {k: v for k, v in kwargs.items() if k in sig.parameters}
        self._options = {k: v for k, v in kwargs.items() if k not in sig.parameters}  # num_warps, launch_pdl, ...
        bound = sig.bind(*args, **params)
        bound.apply_defaults()
        names = list(bound.arguments)
        self._slots = tuple(names.index(n) for n in per_call)
        values = list(bound.arguments.values())
        for s in self._slots:
            values[s] = None  # (no tensor of the first call stays referenced)
        self._values = values
        n = len(self._slots)
        self._head = n if self._slots == tuple(range(n)) else 0  # per-call values that are the leading arguments
        self._tail = tuple(values[self._head:])
        self._fn = fn
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._launch_grid = tuple(grid)
        self._pre_run_hooks = getattr(fn, "pre_run_hooks", None) or []
        self._compiled = None
        self._run = self._function = self._metadata = None

    @property
    def can_direct(self) -> bool:
        return self._run is not None and not self._pre_run_hooks

    def _fill(self, per_call: tuple, values: list | None = None, tail: tuple | None = None) -> list | tuple:
        """The call's arguments: ``per_call`` in their slots of the template ``values`` (leading:
        followed by ``tail``); by default the JIT's template, whose fixed tensors are tensors."""
        if self._head == len(per_call):
            return (*per_call, *(self._tail if tail is None else tail))
        values = list(self._values if values is None else values)
        for s, v in zip(self._slots, per_call):
            values[s] = v
        return values

    def first(self, *tensors) -> None:
        """The JIT call with these tensors (compiling if needed); keep the compiled kernel for :meth:`direct`."""
        compiled = self._fn[self._launch_grid](*self._fill(tensors), **self._options)
        if is_interpreted(self._fn) or not _Driver.load():
            return
        compiled = compiled.result() if hasattr(compiled, "result") else compiled
        run = getattr(compiled, "run", None)
        function = getattr(compiled, "function", None)
        metadata = getattr(compiled, "packed_metadata", None)
        if run is None or function is None or metadata is None:
            return
        self._compiled, self._run, self._function, self._metadata = compiled, run, function, metadata
        # the fixed tensor arguments by address for direct launches: Triton's launcher resolves a
        # tensor argument through its data_ptr() and a driver query on every launch, an int at once
        # (the tensors stay referenced by ``_values``, so the addresses stay valid)
        self._direct_values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in self._values]
        self._direct_tail = tuple(self._direct_values[self._head:])

    def jit(self, *tensors) -> None:
        """The JIT call with these tensors (in ``per_call`` order)."""
        self._fn[self._launch_grid](*self._fill(tensors), **self._options)

    def direct(self, stream: int, *pointers) -> None:
        """Launch the compiled kernel on ``stream`` with these data pointers (ints, ``None`` for ``None``).

        The call Triton's JIT makes once it has found the compiled kernel (launch hooks
        included), with the launch's fixed tensors passed by address. Only where :attr:`can_direct`.
        """
        values = self._fill(pointers, self._direct_values, self._direct_tail)
        knobs = _Driver.runtime_knobs
        enter = knobs.launch_enter_hook
        # (metadata only for a hook to read: none is None, or, in newer Triton, an empty chain of hooks)
        metadata = (None if enter is None or not getattr(enter, "calls", True)
                    else self._compiled.launch_metadata(self._launch_grid, stream, *values))
        g = self._grid
        self._run(g[0], g[1], g[2], stream, self._function, self._metadata, metadata, enter, knobs.launch_exit_hook,
                  *values)


@dataclass(frozen=True)
class RoutingPlan:
    """What the first call of a routing signature settled, for the later calls with it.

    Attributes:
        shape: ``(num_tokens, topk)`` of the outputs.
        device: the device new outputs are allocated on.
        exact_weights, exact_ids: the caller's buffer has exactly ``shape`` (it is returned
            itself; otherwise its leading ``shape`` view is).
        launch: the kernel launch; ``None`` for an empty batch (nothing to launch).
        bias_to_float32: the kernel reads a float32 copy of the bias (the seed's launcher).
        per_stream: for a launch that takes one more tensor per CUDA stream (after the five
            of the call), the dict holding it by ``(device index, raw stream)``; a stream
            without one sends the call down the checked path, which makes it.
        descriptors: for a launch that takes Triton tensor descriptors of the call's logits and bias (after
            the five tensors), what makes them for a call (a descriptor holds its tensor's address):
            ``descriptors.direct(gating_output, bias)`` for a direct launch, ``.jit(...)`` for a JIT one
            (:class:`routetool_kernels.routing.RowDescriptors`).
    """

    shape: tuple[int, int]
    device: torch.device
    exact_weights: bool
    exact_ids: bool
    launch: KernelLaunch | None
    bias_to_float32: bool = False
    per_stream: dict | None = None
    descriptors: Any = None


ROUTING_PER_CALL = ("gating_output_ptr", "bias_ptr", "topk_weights_ptr", "topk_ids_ptr", "is_padding_ptr")
"""The routing kernels' parameters that change from call to call (in this order)."""


def plan_for(shape: tuple[int, int], device: torch.device, topk_weights: torch.Tensor | None,
             topk_ids: torch.Tensor | None, launch: KernelLaunch | None, **kw) -> RoutingPlan:
    """The :class:`RoutingPlan` of a checked call with these (caller's, unsliced) output buffers."""
    return RoutingPlan(shape=shape, device=device,
                       exact_weights=topk_weights is not None and tuple(topk_weights.shape) == shape,
                       exact_ids=topk_ids is not None and tuple(topk_ids.shape) == shape, launch=launch, **kw)


def _output(buf: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
            exact: bool) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return buf if exact else buf[: shape[0], : shape[1]]


def cached_call(cache: PlanCache, tensors: tuple, others: tuple, compiled: bool):
    """Run a routing call from its signature's plan, if ``cache`` has one.

    Args:
        cache: the launcher's plans.
        tensors: ``(gating_output, bias, topk_weights, topk_ids, is_padding)``, as given.
        others: every other argument of the call (see :func:`call_signature`).
        compiled: the launcher's kernels are compiled (not interpreted).

    Returns:
        ``(outputs, key)``: ``outputs`` the ``(topk_weights, topk_ids)`` the launcher returns,
        or ``None`` when the call must take the launcher's checked path (a new signature, an
        argument no key can be made of: then ``key`` is ``None`` too, or a stream the plan has
        no per-stream tensor for).
    """
    try:
        key, pointers, device = call_signature(tensors, others, compiled)
        plan = cache.get(key)
    except Exception:  # noqa: BLE001 - no key: the checked path names what is wrong
        return None, None
    if plan is None:
        return None, key
    gating_output, bias, topk_weights, topk_ids, is_padding = tensors
    w = _output(topk_weights, plan.shape, torch.float32, plan.device, plan.exact_weights)
    ids = _output(topk_ids, plan.shape, torch.int32, plan.device, plan.exact_ids)
    launch = plan.launch
    if launch is None:
        return (w, ids), key
    bias_ptr = pointers[1]
    if plan.bias_to_float32:
        bias = bias.float().contiguous()
        bias_ptr = bias.data_ptr()
    extra = ()
    if plan.descriptors is not None:
        extra = (plan.descriptors.direct if launch.can_direct else plan.descriptors.jit)(gating_output, bias)
    stream = None
    if device is not None:
        stream = _Driver.current_stream(device)
        if plan.per_stream is not None:
            t = plan.per_stream.get((device, stream))
            if t is None:
                return None, key
            extra = (t,)
    if launch.can_direct:
        launch.direct(stream, pointers[0], bias_ptr, pointers[2] if topk_weights is not None else w.data_ptr(),
                      pointers[3] if topk_ids is not None else ids.data_ptr(), pointers[4],
                      *[t.data_ptr() if isinstance(t, torch.Tensor) else t for t in extra])
    else:
        launch.jit(gating_output, bias, w, ids, is_padding, *extra)
    return (w, ids), key
