"""Record a running engine's routing call site (vLLM's ``fused_musespark1x_routing``) into a
sharded routetool trace.

How it works:

* :class:`RoutingRecorder` replaces ``module.function`` (default: the seed's
  ``vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing``; any
  ``module:function`` with the seed's signature works) by a wrapper, through
  ``importlib.import_module`` + ``setattr``. Callers that look the function up through the
  module attribute at call time are recorded. Code that did ``from module import function``
  holds its own reference: name that place too, with ``targets=["its.module:function"]``.
  The originals are put back when recording stops.
* The wrapper calls the original first, unchanged, then copies the call's inputs
  (``gating_output``, ``bias``, ``is_padding``, the scalar parameters) and, by default, its
  outputs (``topk_weights``, ``topk_ids``) to the host. On CUDA the copies are
  ``non_blocking`` into pinned host buffers carved from a preallocated arena, and a CUDA
  event is recorded on the stream after each step; the host never waits for the GPU in the
  wrapper. On the CPU the copies are plain copies.
* Layers: an explicit index (``with recorder.layer(L):``, ``recorder.set_layer(L)``, or a
  ``layer_fn`` callback returning the index) wins; otherwise the *i*-th call of a forward
  step is MoE layer ``layer_ids[i]`` (``range(num_layers)`` by default). A step ends when
  ``num_layers`` calls were seen, when an explicitly numbered layer repeats, or at
  :meth:`RoutingRecorder.step`. Each layer's ``step_offsets`` keep the step boundaries, so
  replay reproduces the production batch shapes.
* Memory is bounded: when ``shard_mb`` MB of recorded data are buffered, the next step
  boundary hands them to a writer thread that waits for the copies' events and writes them
  as one shard (a complete trace v1 file) and rewrites the index (see
  :mod:`routetool.sharded`). At most two arenas of ``shard_mb`` exist; a step larger than
  what is left of an arena gets buffers of its own. A step is never split across shards.
* Sampling: ``every_n_steps`` records one step in N (steps 0, N, 2N, ...);
  ``max_tokens`` stops recording before the first step that would take the recorded token
  rows per layer over the budget (steps are never cut). ``skip_steps`` ignores the first
  steps (warm-up).
* Stopping: on leaving the ``with`` block (normally or by an exception), on :meth:`close`,
  or at interpreter exit (``atexit``) for :meth:`start`-ed recorders, the originals are
  restored, everything recorded so far is written, and the index says whether the run ended
  normally (``complete``) and why it stopped (``stopped_by``).
* The recorder never breaks the run it records: a problem of its own (a full disk, a
  router parameter that changes mid-run, an output it cannot read) stops the recording,
  keeps what was written, and is raised as a :class:`~routetool.errors.RouteToolError` when
  recording stops. The exceptions are CUDA-graph stream capture and ``torch.compile``
  tracing, where a Python wrapper cannot record at all: those raise at once, with the fix.

Example (vLLM, eager mode, engine in this process)::

    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # run the model in this process
    from vllm import LLM
    from routetool.capture.recorder import RoutingRecorder

    llm = LLM(model=..., enforce_eager=True)                  # no CUDA graphs, no torch.compile
    with RoutingRecorder("traces/run.json", num_layers=58, layer_ids=range(3, 61),
                         shard_mb=512, every_n_steps=4, max_tokens=2_000_000) as rec:
        llm.generate(prompts)
    print(rec.stats)
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import inspect
import math
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from routetool.errors import RouteToolError
from routetool.files import check_output_folder, path_kind
from routetool.sharded import shard_path, write_index
from routetool.trace import LayerArrays, RouterConfig, TraceMeta, router_config_errors, write_trace

DEFAULT_TARGET = "vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing"
"""The seed's routing function, the default call site to record."""

SEED_PARAMETERS = (
    "gating_output", "bias", "topk", "route_scale", "router_output_multiplier",
    "router_score_normalization", "router_score_division_eps", "topk_weights", "topk_ids",
)
"""Positional parameters of the seed's signature (``is_padding`` is keyword-only)."""

_DEFAULTS = {
    "router_output_multiplier": None,
    "router_score_normalization": "sigmoid",
    "router_score_division_eps": None,
    "topk_weights": None,
    "topk_ids": None,
    "is_padding": None,
}
_ALIGN = 64
_GRAPH_FIX = (
    "a Python wrapper does not run on CUDA-graph replay, so it cannot record graph-captured steps: "
    "run the recorded steps eagerly (vLLM: LLM(..., enforce_eager=True) or --enforce-eager), "
    "and start recording after the engine is built"
)
_COMPILE_FIX = (
    "the routing call is being traced by torch.compile, where a Python wrapper cannot copy tensors "
    "to the host: run the recorded steps eagerly (vLLM: enforce_eager=True)"
)
_NOTHING_FIX = (
    "the function was never called through the patched attribute: if the caller did "
    "`from module import function`, patch that module too (targets=['caller.module:function']); "
    "for vLLM run the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and eagerly "
    "(enforce_eager=True), since CUDA graphs captured before recording replay without Python"
)


def _stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()``, False where CUDA is absent."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError):
        return False


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - torch < 2.3
        return False


def resolve_target(spec: str) -> tuple[object, str, Callable]:
    """Import ``module:function`` and return ``(module, attribute, current value)``.

    Raises:
        RouteToolError: malformed spec, module not importable, no such attribute, not
            callable, or a signature other than the seed's.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or "." in attr:
        raise RouteToolError(f"target {spec!r} is not module:function",
                             fix="e.g. vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RouteToolError(f"cannot import module {module_name!r} ({exc})",
                             fix="record in the Python environment of the engine, or name the module that "
                                 "holds the routing function") from None
    if not hasattr(module, attr):
        raise RouteToolError(f"module {module_name!r} has no attribute {attr!r}",
                             fix="name the routing function as module:function")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RouteToolError(f"{spec} is not callable", fix="name the routing function as module:function")
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise RouteToolError(f"cannot read the signature of {spec}",
                             fix="record a Python function with the seed's signature") from None
    if params[:4] != list(SEED_PARAMETERS[:4]):
        raise RouteToolError(
            f"{spec} has parameters ({', '.join(params[:4])}, ...), not the seed's "
            f"({', '.join(SEED_PARAMETERS[:4])}, ...)",
            fix="record a function with the signature of fused_musespark1x_routing",
        )
    return module, attr, fn


@dataclass
class RecorderStats:
    """What a :class:`RoutingRecorder` saw and did (``recorder.stats``).

    Attributes:
        calls_seen / calls_recorded: routing calls through the wrapper / of them recorded.
        steps_seen / steps_recorded: forward steps seen / recorded (after sampling).
        tokens_recorded: token rows recorded per layer (the ``max_tokens`` budget counts these).
        bytes_recorded: bytes copied to the host.
        shards_written: shard files written. oneoff_buffers: host buffers allocated outside
            the arenas (a step too large for the arena; raise ``shard_mb`` if this grows).
        writer_waits / writer_wait_s: times (and seconds) the recorded run waited for the
            writer to free an arena (the disk is slower than the recording).
    """

    calls_seen: int = 0
    calls_recorded: int = 0
    steps_seen: int = 0
    steps_recorded: int = 0
    tokens_recorded: int = 0
    bytes_recorded: int = 0
    shards_written: int = 0
    oneoff_buffers: int = 0
    writer_waits: int = 0
    writer_wait_s: float = 0.0


@dataclass
class _Call:
    layer: int
    num_tokens: int
    gating: torch.Tensor
    padding: torch.Tensor | None
    ids: torch.Tensor | None
    weights: torch.Tensor | None


@dataclass
class _Arena:
    """A preallocated host buffer (pinned for CUDA sources) carved into tensor views."""

    buf: torch.Tensor
    offset: int = 0

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        start = -(-self.offset // _ALIGN) * _ALIGN
        if start + nbytes > self.buf.numel():
            return None
        self.offset = start + nbytes
        return self.buf[start:start + nbytes].view(dtype).view(shape)


@dataclass
class _Shard:
    """Recorded steps waiting to be written as one shard."""

    number: int
    calls: list[_Call] = field(default_factory=list)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    events: list = field(default_factory=list)
    arenas: list[_Arena] = field(default_factory=list)
    first_step: int | None = None
    last_step: int | None = None
    num_steps: int = 0
    nbytes: int = 0


class RoutingRecorder:
    """Record every call of a routing function (the seed's signature) into a sharded trace.

    Use as a context manager, or call :meth:`start` and :meth:`close`. See the module
    docstring for how layers, steps, memory, sharding and sampling work.

    Args:
        out: the index file of the sharded trace to write (``.json``); shards are written
            next to it as ``<stem>-00000.safetensors``, ``<stem>-00001.safetensors``, ...
        target: ``module:function`` to record (default :data:`DEFAULT_TARGET`).
        targets: further ``module:attribute`` places that hold the same function (callers
            that imported it with ``from ... import``); all are patched.
        num_layers: MoE layers per forward step (the step ends after this many calls).
            Required unless ``layer_fn`` gives the layer of every call.
        layer_ids: the layer index of the i-th call of a step (default ``range(num_layers)``;
            e.g. ``range(3, 61)`` for DeepSeek-V3, whose first 3 layers are dense).
        layer_fn: optional callback returning the current call's layer index (or None to
            fall back to call order); e.g. reading the engine's forward context.
        shard_mb: write a shard whenever this many MB are buffered (at a step boundary).
        every_n_steps: record one forward step in N.
        max_tokens: stop recording before the step that would take the recorded token rows
            per layer over this budget (None = no budget).
        skip_steps: ignore this many steps first (warm-up), before sampling starts.
        record_outputs: also record the function's outputs (``topk_weights``/``topk_ids``)
            so that replay can compare production routing with the reference.
        model / provenance: trace metadata (defaults describe the recording).
        force: replace an existing index and shards of the same name.
        background: write shards on a writer thread (default); False writes them inline.

    Raises:
        RouteToolError: at construction, for a bad target, bad parameters, an existing
            output (without ``force``) or an unwritable folder; during capture/compile
            tracing (see the module docstring); when recording stops, for a problem of the
            recorder (disk full, router parameters that changed) or a run that recorded
            nothing.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        target: str = DEFAULT_TARGET,
        targets: Sequence[str] = (),
        num_layers: int | None = None,
        layer_ids: Iterable[int] | None = None,
        layer_fn: Callable[[], int | None] | None = None,
        shard_mb: float = 256.0,
        every_n_steps: int = 1,
        max_tokens: int | None = None,
        skip_steps: int = 0,
        record_outputs: bool = True,
        model: str = "",
        provenance: str = "",
        force: bool = False,
        background: bool = True,
    ):
        self.out = Path(out)
        self.target = target
        self.targets = (target, *targets)
        if num_layers is None and layer_fn is None:
            raise RouteToolError("give num_layers (MoE layers per forward step) or layer_fn",
                                 fix="e.g. RoutingRecorder(out, num_layers=58, layer_ids=range(3, 61))")
        self.layer_ids = tuple(layer_ids) if layer_ids is not None else (
            tuple(range(num_layers)) if num_layers is not None else ())
        if num_layers is not None and (num_layers < 1 or len(self.layer_ids) != num_layers):
            raise RouteToolError(f"num_layers={num_layers} but layer_ids has {len(self.layer_ids)} entries",
                                 fix="give one layer index per MoE layer call of a step")
        if len(set(self.layer_ids)) != len(self.layer_ids) or any(i < 0 for i in self.layer_ids):
            raise RouteToolError("layer_ids must be distinct non-negative integers", fix="e.g. range(3, 61)")
        self.num_layers = num_layers
        self.layer_fn = layer_fn
        if not (shard_mb > 0 and math.isfinite(shard_mb)):
            raise RouteToolError(f"shard_mb={shard_mb} must be > 0", fix="e.g. shard_mb=256")
        if every_n_steps < 1 or skip_steps < 0 or (max_tokens is not None and max_tokens < 1):
            raise RouteToolError("every_n_steps must be >= 1, skip_steps >= 0 and max_tokens >= 1",
                                 fix="e.g. every_n_steps=4, max_tokens=1_000_000")
        self.shard_bytes = max(_ALIGN, int(shard_mb * 2**20))
        self.every_n_steps = every_n_steps
        self.max_tokens = max_tokens
        self.skip_steps = skip_steps
        self.record_outputs = record_outputs
        self.force = force
        self.background = background
        self._check_output()
        self.model = model or f"recorded at {target}"
        self.provenance = provenance or (
            f"recorded at the call site {target} by routetool.capture.recorder on {platform.node() or 'unknown host'}, "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; every {every_n_steps} step(s) after "
            f"skipping {skip_steps}, max_tokens={max_tokens}"
        )
        self.stats = RecorderStats()
        self.router: RouterConfig | None = None
        self.error: RouteToolError | None = None
        self.stopped_by: str | None = None
        self._lock = threading.RLock()
        self._local = threading.local()
        self._patches: list[tuple[object, str, Callable, Callable]] = []
        self._active = False
        self._closed = False
        self._started = False
        self._step_index = -1
        self._step_layers: list[int] = []
        self._step_sampled = False
        self._step_streams: dict = {}
        self._layer_dtype: dict[int, torch.dtype] = {}
        self._outputs_ok = record_outputs
        self._shard: _Shard | None = None
        self._arena: _Arena | None = None
        self._free_arenas: list[_Arena] = []
        self._arena_count = 0
        self._arena_cond = threading.Condition(self._lock)
        self._shard_number = 0
        self._written: list[dict] = []
        self._executor: ThreadPoolExecutor | None = None

    # -- set-up ------------------------------------------------------------------------------
    def _check_output(self) -> None:
        out = self.out
        if out.suffix.lower() != ".json":
            raise RouteToolError("the recorder writes a sharded trace: name its index file (.json)", path=out,
                                 fix="e.g. traces/run.json (shards go next to it as run-00000.safetensors, ...)")
        if path_kind(out) == "folder":
            raise RouteToolError("is a directory", path=out, fix="name the index file, e.g. run.json")
        folder = out.parent if str(out.parent) else Path(".")
        check_output_folder(folder)
        if not os.access(folder, os.W_OK):
            raise RouteToolError("folder is not writable", path=folder, fix="choose a writable folder")
        if not self.force:
            existing = [p for p in (out, shard_path(out, 0)) if path_kind(p) not in ("missing", "dangling link")]
            if existing:
                raise RouteToolError("already exists", path=existing[0],
                                     fix="choose another index name or pass force=True to replace the recording")

    def start(self) -> RoutingRecorder:
        """Patch the target(s) and start recording (also registers an ``atexit`` close)."""
        if self._started:
            raise RouteToolError("this recorder was already started", fix="make a new RoutingRecorder per recording")
        self._started = True
        resolved = [resolve_target(spec) for spec in self.targets]
        for module, attr, fn in resolved:
            wrapper = self._make_wrapper(fn)
            setattr(module, attr, wrapper)
            self._patches.append((module, attr, fn, wrapper))
        if self.background:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routetool-recorder")
        self._active = True
        atexit.register(self._atexit)
        return self

    def __enter__(self) -> RoutingRecorder:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    # -- layer / step control -------------------------------------------------------------
    def set_layer(self, layer: int | None) -> None:
        """Layer index of the following routing calls on this thread (None: call order)."""
        self._local.layer = layer

    @contextlib.contextmanager
    def layer(self, layer: int) -> Iterator[None]:
        """``with recorder.layer(L): fn(...)``: calls inside are recorded as layer ``L``."""
        previous = getattr(self._local, "layer", None)
        self._local.layer = layer
        try:
            yield
        finally:
            self._local.layer = previous

    def step(self) -> None:
        """End the current forward step now (the next call starts a new one)."""
        with self._lock:
            self._end_step()

    # -- the wrapper ------------------------------------------------------------------------
    def _make_wrapper(self, fn: Callable) -> Callable:
        recorder = self

        def wrapper(*args, **kwargs):
            if not recorder._active:
                return fn(*args, **kwargs)
            if _stream_capturing() or _compiling():
                capturing = _stream_capturing()
                err = RouteToolError(
                    "routing call recorded during " + ("CUDA-graph stream capture" if capturing else
                                                       "torch.compile tracing"),
                    path=recorder.out, fix=_GRAPH_FIX if capturing else _COMPILE_FIX)
                with recorder._lock:
                    recorder._fail(err)
                raise err
            with recorder._lock:
                position = recorder._begin_call(args, kwargs) if recorder._active else None
            out = fn(*args, **kwargs)
            if position is not None:
                with recorder._lock:
                    if recorder._active:
                        try:
                            recorder._record_call(position, args, kwargs, out)
                        except RouteToolError as exc:
                            recorder._fail(exc)
                        except Exception as exc:  # never break the recorded run
                            recorder._fail(RouteToolError(f"recording failed ({type(exc).__name__}: {exc})",
                                                          path=recorder.out, fix="report this as a routetool bug"))
                    if recorder.num_layers is not None and len(recorder._step_layers) >= recorder.num_layers:
                        recorder._end_step()
            return out

        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", "routing")
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        wrapper.__routetool_recorder__ = self
        return wrapper

    @staticmethod
    def _params(args: tuple, kwargs: dict) -> dict:
        params = dict(_DEFAULTS)
        params.update(zip(SEED_PARAMETERS, args))
        params.update(kwargs)
        return params

    def _begin_call(self, args: tuple, kwargs: dict) -> tuple[int, bool] | None:
        """Step/layer bookkeeping before the original runs: (layer, sampled) or None."""
        self.stats.calls_seen += 1
        explicit = getattr(self._local, "layer", None)
        if explicit is None and self.layer_fn is not None:
            explicit = self.layer_fn()
        if explicit is not None:
            explicit = int(explicit)
            if explicit in self._step_layers:
                self._end_step()
            layer = explicit
        else:
            if self.num_layers is None:
                self._fail(RouteToolError("a routing call without a layer index and no num_layers to count calls",
                                          fix="give num_layers, or make layer_fn return an index for every call"))
                return None
            position = len(self._step_layers)
            if position >= self.num_layers:
                self._end_step()
                position = 0
            layer = self.layer_ids[position]
        if not self._step_layers:
            self._start_step(args, kwargs)
        self._step_layers.append(layer)
        return layer, self._step_sampled

    def _start_step(self, args: tuple, kwargs: dict) -> None:
        self._step_index += 1
        self.stats.steps_seen += 1
        n = self._step_index - self.skip_steps
        sampled = n >= 0 and n % self.every_n_steps == 0
        if sampled and self.max_tokens is not None:
            g = self._params(args, kwargs)["gating_output"]
            rows = int(g.shape[0]) if isinstance(g, torch.Tensor) and g.dim() == 2 else 0
            if self.stats.tokens_recorded + rows > self.max_tokens:
                self.stopped_by = "max_tokens"
                self._active = False
                sampled = False
        self._step_sampled = sampled
        if sampled:
            self.stats.steps_recorded += 1
            if self._shard is None:
                self._shard = _Shard(number=self._shard_number)
                self._shard_number += 1
            shard = self._shard
            shard.first_step = self._step_index if shard.first_step is None else shard.first_step
            shard.last_step = self._step_index
            shard.num_steps += 1
            self._step_tokens_counted = False

    def _end_step(self) -> None:
        if not self._step_layers:
            return
        self._step_layers = []
        if self._step_sampled and self._shard is not None:
            for stream in self._step_streams.values():
                event = torch.cuda.Event()
                event.record(stream)
                self._shard.events.append(event)
            self._step_streams = {}
            if self._shard.nbytes >= self.shard_bytes or self._shard_overflowed:
                self._flush()
        self._step_sampled = False

    _shard_overflowed = False
    _step_tokens_counted = False
    _write_failed = False

    def _host(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A host copy of ``t`` (optionally converted), in the arena when it fits."""
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        pin = t.is_cuda
        if self._arena is None:
            self._arena = self._new_arena(pin)
            self._shard.arenas.append(self._arena)
        dst = self._arena.take(t.shape, t.dtype)
        if dst is None:
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self.stats.oneoff_buffers += 1
            self._shard_overflowed = True
        dst.copy_(t, non_blocking=pin)
        if pin:
            self._step_streams.setdefault(t.device, torch.cuda.current_stream(t.device))
        nbytes = t.numel() * t.element_size()
        self._shard.nbytes += nbytes
        self.stats.bytes_recorded += nbytes
        return dst

    def _new_arena(self, pin: bool) -> _Arena:
        if self._free_arenas:
            arena = self._free_arenas.pop()
            arena.offset = 0
            return arena
        while self._arena_count >= 2:
            t0 = time.perf_counter()
            self.stats.writer_waits += 1
            self._arena_cond.wait(timeout=1.0)
            self.stats.writer_wait_s += time.perf_counter() - t0
            if self._free_arenas:
                arena = self._free_arenas.pop()
                arena.offset = 0
                return arena
            if self.error is not None:
                raise self.error
        self._arena_count += 1
        return _Arena(torch.empty(self.shard_bytes, dtype=torch.uint8, pin_memory=pin))

    def _router_of(self, p: dict, num_experts: int) -> RouterConfig:
        def opt(v):
            return None if v is None else float(v)

        return RouterConfig(
            num_experts=num_experts, topk=int(p["topk"]), route_scale=float(p["route_scale"]),
            router_score_normalization=str(p["router_score_normalization"]),
            router_output_multiplier=opt(p["router_output_multiplier"]),
            router_score_division_eps=opt(p["router_score_division_eps"]),
        )

    def _record_call(self, position: tuple[int, bool], args: tuple, kwargs: dict, out) -> None:
        layer, sampled = position
        if not sampled:
            return
        p = self._params(args, kwargs)
        g = p["gating_output"]
        where = f"layers.{layer}.gating_output"
        if not isinstance(g, torch.Tensor) or g.dim() != 2:
            raise RouteToolError(f"gating_output of layer {layer} is not a 2-D tensor", path=self.out, tensor=where,
                                 fix="record a function with the seed's signature")
        n, num_experts = int(g.shape[0]), int(g.shape[1])
        router = self._router_of(p, num_experts)
        if self.router is None:
            problems = router_config_errors(router)
            if problems:
                raise RouteToolError("; ".join(problems), path=self.out, tensor="__metadata__",
                                     fix="the recorded call's parameters cannot form a trace")
            self.router = router
        elif router != self.router:
            raise RouteToolError(
                f"router parameters changed during the run (layer {layer}: {router}; first call: {self.router})",
                path=self.out, tensor="__metadata__",
                fix="a trace holds one router configuration; record runs with different parameters separately",
            )
        if self._layer_dtype.setdefault(layer, g.dtype) != g.dtype:
            raise RouteToolError(f"layer {layer}'s gating_output changed dtype from {self._layer_dtype[layer]} to "
                                 f"{g.dtype}", path=self.out, tensor=where, fix="record runs of one dtype")
        if n == 0:
            return  # an empty call carries nothing to replay (trace steps are never empty)
        shard = self._shard
        bias = p["bias"]
        if layer not in shard.bias:
            shard.bias[layer] = self._host(bias, torch.float32) if bias.dtype not in (
                torch.float32, torch.bfloat16, torch.float16) else self._host(bias)
        gating = self._host(g)
        pad = p["is_padding"]
        padding = self._host(pad) if isinstance(pad, torch.Tensor) else None
        ids = weights = None
        if self._outputs_ok:
            try:
                w_out, ids_out = out
                ok = (isinstance(w_out, torch.Tensor) and isinstance(ids_out, torch.Tensor)
                      and tuple(w_out.shape) == (n, router.topk) and tuple(ids_out.shape) == (n, router.topk))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise RouteToolError(f"the function did not return (topk_weights [{n}, {router.topk}], topk_ids "
                                     f"[{n}, {router.topk}])", path=self.out, tensor=f"layers.{layer}.topk_ids",
                                     fix="pass record_outputs=False to record inputs only")
            weights = self._host(w_out, torch.float32 if w_out.dtype not in (
                torch.float32, torch.bfloat16, torch.float16) else None)
            ids = self._host(ids_out, torch.int32)
        shard.calls.append(_Call(layer=layer, num_tokens=n, gating=gating, padding=padding, ids=ids, weights=weights))
        self.stats.calls_recorded += 1
        if not self._step_tokens_counted:
            self.stats.tokens_recorded += n
            self._step_tokens_counted = True

    # -- flushing ---------------------------------------------------------------------------
    def _flush(self) -> None:
        """Hand the buffered shard to the writer (called at a step boundary, under the lock)."""
        shard, self._shard, self._arena = self._shard, None, None
        self._shard_overflowed = False
        if shard is None or not shard.calls:
            if shard is not None:
                self._release(shard)
            return
        if self._executor is not None:
            self._executor.submit(self._write_shard, shard)
        else:
            self._write_shard(shard)

    def _release(self, shard: _Shard) -> None:
        with self._arena_cond:
            self._free_arenas.extend(shard.arenas)
            shard.arenas = []
            self._arena_cond.notify_all()

    def _shard_meta(self, shard: _Shard) -> TraceMeta:
        extra = {
            "capture": f"routetool.capture.recorder ({self.target})",
            "sampling": f"every_n_steps={self.every_n_steps} skip_steps={self.skip_steps} max_tokens={self.max_tokens}",
            "shard": str(shard.number),
            "first_step": str(shard.first_step),
            "last_step": str(shard.last_step),
        }
        if self.record_outputs and self._outputs_ok:
            extra["weights_semantics"] = "renormalized"
        return TraceMeta(model=self.model, router=self.router, provenance=self.provenance, extra=extra)

    def _write_shard(self, shard: _Shard) -> None:
        path = shard_path(self.out, shard.number)
        try:
            if self._write_failed:  # the disk failed before: keep the shards written, stop writing
                self._release(shard)
                return
            for event in shard.events:
                event.synchronize()
            by_layer: dict[int, list[_Call]] = {}
            for call in shard.calls:
                by_layer.setdefault(call.layer, []).append(call)
            layers: dict[int, LayerArrays] = {}
            for layer, calls in by_layer.items():
                any_pad = any(c.padding is not None for c in calls)
                with_outputs = all(c.ids is not None for c in calls)
                padding = None
                if any_pad:  # calls without a mask are unpadded
                    padding = torch.cat([c.padding if c.padding is not None else
                                         torch.zeros(c.num_tokens, dtype=torch.bool) for c in calls])
                layers[layer] = LayerArrays(
                    gating_output=torch.cat([c.gating for c in calls]),
                    bias=shard.bias[layer].clone(),
                    is_padding=padding,
                    step_offsets=torch.tensor([0] + [c.num_tokens for c in calls], dtype=torch.int64).cumsum(0),
                    topk_ids=torch.cat([c.ids for c in calls]) if with_outputs else None,
                    topk_weights=torch.cat([c.weights for c in calls]) if with_outputs else None,
                )
            shard.calls = []
            self._release(shard)  # the data now lives in the concatenated tensors
            write_trace(path, self._shard_meta(shard), layers, force=self.force)
            entry = {"path": path.name, "size_bytes": path.stat().st_size, "num_steps": shard.num_steps,
                     "first_step": shard.first_step, "last_step": shard.last_step}
            with self._lock:
                self._written.append(entry)
                self.stats.shards_written += 1
                written = list(self._written)
            write_index(self.out, written, complete=False, stopped_by=None, extra=self._index_extra())
        except RouteToolError as exc:
            self._release(shard)
            with self._lock:
                self._write_failed = True
                self._fail(exc)
        except Exception as exc:
            self._release(shard)
            with self._lock:
                self._write_failed = True
                self._fail(RouteToolError(f"cannot write shard ({type(exc).__name__}: {exc})", path=path,
                                          fix="check free disk space and permissions"))

    def _index_extra(self) -> dict:
        return {"created_by": "routetool.capture.recorder", "target": self.target}

    def _fail(self, exc: RouteToolError) -> None:
        """A problem of the recorder: stop recording, keep what was written, raise at close."""
        if self.error is None:
            self.error = exc
            self.stopped_by = f"recorder error: {exc}"
        self._active = False
        with self._arena_cond:
            self._arena_cond.notify_all()

    # -- stopping ------------------------------------------------------------------------------
    def _unpatch(self) -> None:
        for module, attr, fn, wrapper in reversed(self._patches):
            if getattr(module, attr, None) is wrapper:
                setattr(module, attr, fn)
            else:
                warnings.warn(f"routetool recorder: {module.__name__}.{attr} was replaced by someone else while "
                              "recording; left as it is", stacklevel=3)
        self._patches.clear()

    def _atexit(self) -> None:
        try:
            self.close()
        except RouteToolError as exc:
            warnings.warn(f"routetool recorder: {exc}", stacklevel=1)

    def close(self, exc: BaseException | None = None) -> None:
        """Stop recording: restore the originals, write what is buffered, finish the index.

        Args:
            exc: the exception that ended the recorded run, if any (the index then says
                ``complete: false`` and ``stopped_by: "error: ..."``; it is not raised here).

        Raises:
            RouteToolError: (only when ``exc`` is None) a problem of the recorder during
                the run, or a run that recorded nothing.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._unpatch()
        with self._lock:
            self._active = False
            if self._step_sampled:
                self._end_step()
            self._flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if exc is not None:
            stopped_by = f"error: {type(exc).__name__}: {exc}"
        elif self.error is not None:
            stopped_by = self.stopped_by
        else:
            stopped_by = self.stopped_by or "exit"
        complete = exc is None and self.error is None
        if self._written:
            try:
                write_index(self.out, self._written, complete=complete, stopped_by=stopped_by,
                            extra=self._index_extra())
            except RouteToolError as index_error:
                if self.error is None:
                    self.error = index_error
        self.stopped_by = stopped_by
        if exc is not None:
            if self.error is not None and hasattr(exc, "add_note"):
                exc.add_note(f"routetool recorder: {self.error}")
            return
        if self.error is not None:
            raise self.error
        if self.stats.calls_seen == 0:
            raise RouteToolError(f"the recorder saw no call of {', '.join(self.targets)}", path=self.out,
                                 fix=_NOTHING_FIX)
        if not self._written:
            raise RouteToolError(
                f"recorded no step ({self.stats.calls_seen} calls in {self.stats.steps_seen} steps seen; "
                f"skip_steps={self.skip_steps}, every_n_steps={self.every_n_steps}, max_tokens={self.max_tokens})",
                path=self.out, fix="lower skip_steps/every_n_steps or raise max_tokens above one step's tokens",
            )
