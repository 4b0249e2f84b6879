"""Record a running engine's routing call site (vLLM's ``fused_musespark1x_routing``) into a
sharded routetool trace, also under CUDA graphs, torch.compile, and in every worker process.

How it works:

* :class:`RoutingRecorder` puts a wrapper wherever the target function (default: vLLM 0.33's
  ``vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing``; any
  ``module:function`` with the seed's signature works) is bound at module level, however the
  engine imported it (:mod:`routetool.capture.binding`): at :meth:`~RoutingRecorder.start`,
  every attribute of a loaded module that *is* the original (the defining module and every
  ``from module import function``, vLLM's two MuseSpark1x call sites); while recording, the
  modules the engine imports later (an import hook), so that nothing depends on whether the
  recorder or the model came first. The originals are put back when recording stops.
  ``stats.bindings`` names the bindings, ``stats.model_steps`` the steps ended by
  :meth:`~RoutingRecorder.step`; model steps without a single routing call after the first
  are said loudly (a ``"recorded": "nothing"`` index), never an empty success.
* The wrapper calls the original first, unchanged, then the custom op
  ``torch.ops.routetool.record_routing`` (:mod:`routetool.capture.ring`): one kernel that
  copies the call's ``gating_output``, ``bias``, ``is_padding`` and, by default, its outputs
  (``topk_weights``, ``topk_ids``) into a preallocated ring buffer on the call's device, at
  rows the kernel claims from device-side counters. Its router parameters are the op's
  arguments. No host sync, no Python on replay: a CUDA graph captured while recording
  repeats the copy on every replay, and torch.compile keeps the op as one opaque call. On the
  CPU the same op runs eagerly. Run eagerly (an engine's prefill), the wrapper calls the op's
  host side itself: the first call of a signature is checked and leaves a plan, later ones
  launch the compiled record kernel directly (as :mod:`routetool_kernels._dispatch` does for routing).
* The host drains the ring off the hot path, on the thread that runs the model, while no
  graph is being captured: at most every ``drain_interval_s`` when a routing call runs in
  Python, at :meth:`RoutingRecorder.drain` / :meth:`RoutingRecorder.step` (the vLLM plugin
  calls it after every model step; under CUDA-graph replay nothing else runs Python), and at
  the end. A drain enqueues copies of the complete steps into pinned memory and the release
  of their rows; a writer thread (no CUDA calls) turns landed copies into shards (complete
  trace v1 files of ``shard_mb``, or fewer steps once the oldest pending one is ``shard_s``
  old, and at :meth:`~RoutingRecorder.flush`), each written aside, synced and renamed into
  place before the index (rewritten the same way) lists it, with the last complete step (see
  :mod:`routetool.io.sharded`). A process killed at any moment leaves a readable trace of every
  listed shard: it loses the steps still in the ring and at most ``shard_s`` seconds of drained
  ones, none written before a ``flush()``.
* Memory is bounded: the ring (``ring_mb``) on the device, the drained copies in flight and
  one pending shard on the host. When the ring is full a sampled step is dropped whole and
  counted, never written over rows the host has not copied; so is a step larger than the
  ring. The index records the drops.
* Layers: an explicit index (``with recorder.layer(L):``, ``recorder.set_layer(L)``, or a
  ``layer_fn`` callback returning the index) wins; otherwise the *i*-th call of a forward
  step is MoE layer ``layer_ids[i]`` (``range(num_layers)`` by default). A step ends when
  ``num_layers`` calls were seen, when an explicitly numbered layer repeats, or at
  :meth:`RoutingRecorder.step`. These decisions are taken on the device (they hold on graph
  replay); inside compiled code and graph replays, explicit layer indexes are those Python
  saw when it traced or captured the call. Each layer's ``step_offsets`` keep the step
  boundaries, so replay reproduces the production batch shapes.
* The recorder knows its calls per step and refuses, loudly, the first step that disagrees
  with ``num_layers`` (judged on the device from ``skip_steps`` on): a step boundary
  (:meth:`~RoutingRecorder.step`, the plugin's step hook) after a number of calls that is not
  a whole number of ``num_layers`` (whole extra forwards, such as vLLM's dummy batches, are
  steps), or a call whose rows differ from its step's first call (the calls of one step route
  the same tokens). Recording stops there, that step and everything after it are never
  written, a warning is given once, the index names the refused step and the error is raised
  when recording stops. Without boundaries a wrong count shows in the rows when batch sizes
  change, and in each layer's bias (compared with the layer's first, bit for bit) when layers
  have their own; a count off by a whole multiple of the model's layers, at constant batch
  sizes and with equal biases (say, all zero), cannot be told from a right one.
* A step the run stopped inside (an exception or Ctrl-C in the model step: the boundary is
  then ``step(interrupted=True)``, or a step short of calls at close) is dropped and named in
  the index (``recording.not_written``), so that no layer holds a step the others lack.
* Sampling, decided on the device: ``every_n_steps`` records one step in N (steps 0, N, 2N, ...
  after ``skip_steps`` warm-up steps); ``max_tokens`` stops recording before the first step
  that would take the recorded token rows per layer over the budget (steps are never cut).
* Ranks: each process records itself. ``out`` may hold ``{rank}``
  (``RUN/rank-{rank}/trace.json``), filled in at the first call from
  :func:`routetool.capture.ranks.detect_ranks` (or ``ranks=``); the rank, world size and
  DP/TP/EP/PP ranks go into every shard's metadata and the index.
* Stopping: on leaving the ``with`` block (normally or by an exception), on :meth:`close`,
  or at interpreter exit (``atexit``) for :meth:`start`-ed recorders, the originals are
  restored, everything recorded so far is written, and the index says whether the run ended
  normally (``complete``) and why it stopped (``stopped_by``).
* The recorder never breaks the run it records: a problem of its own (a full disk, a
  router parameter or bias that changes mid-run, an output it cannot read) stops the
  recording, keeps what was written, and is raised as a
  :class:`~routetool.errors.RouteToolError` when recording stops.

Example (vLLM in this process; for worker processes use the plugin,
:mod:`routetool.capture.vllm_plugin`)::

    from vllm import LLM
    from routetool.capture.recorder import RoutingRecorder

    llm = LLM(model=...)                      # CUDA graphs and torch.compile as in production
    with RoutingRecorder("traces/run.json", num_layers=58, layer_ids=range(3, 61),
                         every_n_steps=4, max_tokens=2_000_000) as rec:
        llm.generate(prompts)
    print(rec.stats)
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import platform
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from routetool_kernels._dispatch import _Driver, call_signature
from routetool.capture import ring as ring_mod
from routetool.capture.binding import (SEED_PARAMETERS, Bindings, check_routing_function, import_target,
                                       split_target)
from routetool.capture.ranks import RankInfo, detect_ranks
from routetool.errors import RouteToolError
from routetool.io.paths import check_output_folder, path_kind
from routetool.io.sharded import shard_path, write_index
from routetool.io.trace import LayerArrays, RouterConfig, TraceMeta, router_config_errors, write_trace

DEFAULT_TARGET = "vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing"
"""vLLM 0.33's MuseSpark1x routing kernel (the seed's function), the default target to record."""

_DEFAULTS = {
    **RouterConfig.call_defaults(),
    "topk_weights": None,
    "topk_ids": None,
    "is_padding": None,
}
_GATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NOTHING_FIX = (
    "check that the engine calls this function in this process (another kernel, or a CPU path that "
    "routes in torch?) and name the function it does call (target=..., targets=['module:function']); "
    "for vLLM with worker processes use the plugin (ROUTETOOL_CAPTURE_DIR), which records inside every worker"
)
_CAPTURED_FIRST_FIX = (
    "run one step eagerly before capturing graphs (engines do: a warm-up or profile run), or give the "
    "recorder its device up front: RoutingRecorder(..., device='cuda:0')"
)
_MAX_COPIES_IN_FLIGHT = 4
_MAX_NOTED_STEPS = 100  # dropped steps the index names one by one (all are counted)
_MAX_PLANS = 4096  # launch plans a ring keeps (one more empties them: a call is re-checked, never wrong)


def _stream_capturing(device: torch.device | None = None) -> bool:
    """``torch.cuda.is_current_stream_capturing()`` for work on ``device``: False for the CPU
    and where CUDA is absent."""
    if device is not None and device.type != "cuda":
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError, AttributeError):
        return False


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)  # (torch < 2.3: never)


def _current_device_function() -> Callable[[], int]:
    """The current device's index as Triton's launches see it, for a process where CUDA is
    initialized: torch's C function itself where Triton asks torch (``torch.cuda.current_device``
    checks the lazy initialization first, on every call)."""
    if _Driver.current_device is None:
        _Driver.load()
    fast = getattr(torch._C, "_cuda_getDevice", None)
    return fast if _Driver.current_device is torch.cuda.current_device and fast is not None else _Driver.current_device


def resolve_target(spec: str) -> tuple[object, str, Callable]:
    """Import ``module:function`` and return ``(module, attribute, current value)``.

    Raises:
        RouteToolError: malformed spec, module not importable, no such attribute, not
            callable, or a signature other than the seed's.
    """
    module = import_target(spec)
    attr = split_target(spec)[1]
    fn = getattr(module, attr)
    check_routing_function(spec, fn)
    return module, attr, fn


@dataclass
class RecorderStats:
    """What a :class:`RoutingRecorder` saw and did (``recorder.stats``), as of its last drain.

    Attributes:
        calls_seen / calls_recorded: routing calls that reached the record op (graph replays
            included) / of them stored in the ring.
        steps_seen / steps_recorded: forward steps seen / stored in the ring (after sampling).
        steps_written: recorded steps written into shards.
        steps_dropped: sampled steps dropped because the ring was full (the host drained too
            rarely or the disk was slow: call ``drain()`` more often or raise ``ring_mb``).
        steps_too_large: sampled steps dropped because one step needs more rows than the
            whole ring (raise ``ring_mb``).
        steps_not_written: recorded steps the host dropped: the run stopped inside them
            (interrupted), or their calls disagreed with ``num_layers`` (the index names them).
        calls_dropped: calls of a recorded step not stored (rows other than the step's first
            call, or more calls than ``max_layers``).
        tokens_recorded: token rows recorded per layer (the ``max_tokens`` budget counts these).
        bytes_recorded: bytes of recorded tensors handed to the shard writer.
        shards_written: shard files written. drains: copies of drained steps made.
        ring_bytes / ring_rows: the ring's size and the token rows (of one call) it holds.
        bindings: ``module.attribute`` of every module-level binding of the target that holds
            the wrapper (the defining module and each module that imported the function with
            ``from ... import``): the places the recorder can see calls from.
        model_steps: model steps ended by :meth:`RoutingRecorder.step` while recording (the
            plugin's step hook calls it after each model step).
    """

    calls_seen: int = 0
    calls_recorded: int = 0
    steps_seen: int = 0
    steps_recorded: int = 0
    steps_written: int = 0
    steps_dropped: int = 0
    steps_too_large: int = 0
    steps_not_written: int = 0
    calls_dropped: int = 0
    tokens_recorded: int = 0
    bytes_recorded: int = 0
    shards_written: int = 0
    drains: int = 0
    ring_bytes: int = 0
    ring_rows: int = 0
    bindings: list[str] = field(default_factory=list)
    model_steps: int = 0


@dataclass
class _Shard:
    """Drained steps waiting to be written as one shard."""

    number: int
    steps: list[ring_mod.RingStep] = field(default_factory=list)
    nbytes: int = 0
    started: float = 0.0  # time.monotonic() when its first step arrived


class RoutingRecorder:
    """Record every call of a routing function (the seed's signature) into a sharded trace.

    Use as a context manager, or call :meth:`start` and :meth:`close`. See the module
    docstring for how layers, steps, memory, sharding, sampling and ranks work.

    Args:
        out: the index file of the sharded trace to write (``.json``); shards are written
            next to it as ``<stem>-00000.safetensors``, ``<stem>-00001.safetensors``, ...
            It may hold ``{rank}``, filled in with the process's rank at the first call
            (e.g. ``RUN/rank-{rank}/trace.json``; the ``rank-<r>`` folder is created then).
        target: ``module:function`` to record (default :data:`DEFAULT_TARGET`).
        targets: further ``module:function`` targets. A target's bindings in other modules
            (callers that imported it with ``from ... import``) need not be named: every
            module-level binding of the function gets the wrapper.
        num_layers: MoE layers per forward step (the step ends after this many calls).
            Required unless ``layer_fn`` gives the layer of every call.
        layer_ids: the layer index of the i-th call of a step (default ``range(num_layers)``;
            e.g. ``range(3, 61)`` for DeepSeek-V3, whose first 3 layers are dense).
        layer_fn: optional callback returning the current call's layer index (or None to
            fall back to call order); e.g. reading the engine's forward context.
        shard_mb: write a shard whenever this many MB of drained steps are pending.
        shard_s: write a shard once the oldest pending drained step is this many seconds old
            (checked as steps arrive and at each drain): a process killed without closing loses
            at most the steps still in the ring and the last ``shard_s`` seconds (at most
            ``shard_mb``) of drained ones; nothing written before :meth:`flush`.
        every_n_steps: record one forward step in N.
        max_tokens: stop recording before the step that would take the recorded token rows
            per layer over this budget (None = no budget).
        skip_steps: ignore this many steps first (warm-up), before sampling starts.
        record_outputs: also record the function's outputs (``topk_weights``/``topk_ids``)
            so that replay can compare production routing with the reference.
        router: the router's semantics beyond the seed's signature, as the model routes
            (:class:`~routetool_kernels.spec.RouterSpec`: group-limited routing, ``norm_topk_prob``;
            docs/semantics.md), for an engine whose function takes the seed's arguments and routes
            more than they say. The trace's router is this spec; each call's own parameters (the
            experts, ``topk``, ``route_scale``, the scoring function, multiplier and eps) must be
            the spec's, or recording stops. The recorded weights are labelled ``unnormalized``
            when it says ``norm_topk_prob=False``. None: the calls' parameters alone.
        model / provenance: trace metadata (defaults describe the recording).
        force: replace an existing index and shards of the same name.
        background: write shards on a writer thread (default); False writes them inline.
        ring_mb: size of the ring buffer on the recorded calls' device, MiB; it must hold the
            largest recorded step (rows x calls x (experts x logit bytes + topk x 8 + 1) bytes).
        ring_steps: step slots of the ring (recorded steps that can wait for a drain).
        max_layers: the most distinct layers / calls per step the ring keeps (default
            ``max(64, num_layers)``).
        device: allocate the ring on this device at :meth:`start` (default: at the first
            call, on its device; give it when the first call is CUDA-graph captured or traced
            by ``torch.compile(fullgraph=True)``).
        drain_interval_s: at most this often a routing call run in Python drains the ring
            (0: at every call).
        ranks: this process's :class:`~routetool.capture.ranks.RankInfo` (default: detected
            at the first call).
        paused: start paused (:meth:`pause`): calls launch the record kernel, so graphs
            captured now record once :meth:`resume` is called, but nothing is stored yet.
        require_calls: a recording that saw no call is an error when it stops (False: it
            ends quietly, writing nothing, for processes that may never route, as the
            plugin's engine and API processes; unless model steps were ended by
            :meth:`step` and none of them called the target: then the index is written as a
            ``"recorded": "nothing"`` record and :attr:`recorded_nothing` says why).
        import_targets: import a target's module at :meth:`start` when it is not loaded yet
            (an error if it cannot be imported); False: bind it when the engine imports it
            (the plugin, which loads before the engine imports the model).

    Raises:
        RouteToolError: at construction, for a bad target, bad parameters, an existing
            output (without ``force``) or an unwritable folder; when recording stops, for a
            problem of the recorder (disk full, router parameters or bias that changed) or a
            run that recorded nothing.
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
        shard_s: float = 1.0,
        every_n_steps: int = 1,
        max_tokens: int | None = None,
        skip_steps: int = 0,
        record_outputs: bool = True,
        router: RouterConfig | None = None,
        model: str = "",
        provenance: str = "",
        force: bool = False,
        background: bool = True,
        ring_mb: float = 256.0,
        ring_steps: int = 256,
        max_layers: int | None = None,
        device: str | torch.device | None = None,
        drain_interval_s: float = 0.05,
        ranks: RankInfo | None = None,
        paused: bool = False,
        require_calls: bool = True,
        import_targets: bool = True,
    ):
        self.out_template = str(out)
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
        if not (ring_mb > 0 and math.isfinite(ring_mb)):
            raise RouteToolError(f"ring_mb={ring_mb} must be > 0", fix="e.g. ring_mb=256")
        if every_n_steps < 1 or skip_steps < 0 or (max_tokens is not None and max_tokens < 1):
            raise RouteToolError("every_n_steps must be >= 1, skip_steps >= 0 and max_tokens >= 1",
                                 fix="e.g. every_n_steps=4, max_tokens=1_000_000")
        self.max_layers = max_layers if max_layers is not None else max(64, len(self.layer_ids))
        if ring_steps < 1 or self.max_layers < max(1, len(self.layer_ids)):
            raise RouteToolError(f"ring_steps={ring_steps} must be >= 1 and max_layers={self.max_layers} at least "
                                 f"num_layers", fix="e.g. ring_steps=256")
        if not (drain_interval_s >= 0 and math.isfinite(drain_interval_s)):
            raise RouteToolError(f"drain_interval_s={drain_interval_s} must be >= 0", fix="e.g. 0.05")
        self.shard_bytes = max(64, int(shard_mb * 2**20))
        if not (shard_s >= 0 and math.isfinite(shard_s)):
            raise RouteToolError(f"shard_s={shard_s} must be >= 0 seconds", fix="e.g. shard_s=5")
        self.shard_s = float(shard_s)
        self.ring_bytes = int(ring_mb * 2**20)
        header = ring_mod.header_layout(self.ring_bytes, ring_steps, self.max_layers).header_bytes
        if header >= self.ring_bytes // 2:
            raise RouteToolError(f"ring_mb={ring_mb} leaves too little room for rows: {ring_steps} step slots x "
                                 f"{self.max_layers} layers take {header} bytes of it",
                                 fix="raise ring_mb or lower ring_steps / max_layers")
        self.ring_steps = ring_steps
        self.every_n_steps = every_n_steps
        self.max_tokens = max_tokens
        self.skip_steps = skip_steps
        self.record_outputs = record_outputs
        if router is not None and router_config_errors(router):
            raise RouteToolError(f"router: {'; '.join(router_config_errors(router))}",
                                 fix="give the router the model routes with (docs/semantics.md)")
        self.given_router = router
        self.force = force
        self.background = background
        self.device = torch.device(device) if device is not None else None
        self.drain_interval_s = drain_interval_s
        self.ranks = ranks
        self.require_calls = require_calls
        self.import_targets = import_targets
        self.recorded_nothing: str | None = None
        self._paused = paused
        self._deferred_out = "{rank}" in self.out_template
        self._check_output(deferred=self._deferred_out)
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
        self._current_device: Callable[[], int] | None = None  # the planned path's, found at its first call
        self._bindings: Bindings | None = None
        self._active = False
        self._closed = False
        self._started = False
        self._layers: list[int] = list(self.layer_ids)  # layer position -> layer index
        self._position_of: dict[int, int] = {layer: i for i, layer in enumerate(self._layers)}
        self._sites: dict[tuple, int] = {}
        self._ring: ring_mod.DeviceRing | None = None
        # the tensor the record op is declared to mutate (the ring is found by the handle): it exists
        # before the ring does, so that code compiled before the first call records too
        self._token = torch.zeros(1, dtype=torch.uint8)
        self._handle = ring_mod.register_sink(self)
        self._snapshot: ring_mod.RingSnapshot | None = None
        self._copies: deque[ring_mod.RingCopy] = deque()
        self._released = (0, 0)  # (virtual rows, step slots) handed to the writer: one attribute, set at once
        self._last_drain = 0.0
        self._state: list[int] | None = None
        self._stop_pending = False
        self._backlog = 0
        self._bias: dict[int, torch.Tensor] = {}
        self._shard: _Shard | None = None
        self._shard_number = 0
        self._last_drops = 0
        self._discarding = False
        self._written: list[dict] = []
        self._refused_from: int | None = None  # the first step whose calls disagreed with num_layers
        self._interrupted: set[int] = set()  # steps the run stopped inside (found at close)
        self._not_written: list[dict] = []  # recorded steps dropped by the host: {"step": N, "why": ...}
        self._age_write_queued = False
        self._executor: ThreadPoolExecutor | None = None

    # -- set-up ------------------------------------------------------------------------------
    def _check_output(self, deferred: bool = False) -> None:
        out = self.out
        if out.suffix.lower() != ".json":
            raise RouteToolError("the recorder writes a sharded trace: name its index file (.json)", path=out,
                                 fix="e.g. traces/run.json (shards go next to it as run-00000.safetensors, ...)")
        if deferred:  # RUN/rank-{rank}/trace.json: the run folder must exist, the rank folder is made later
            parts = Path(self.out_template).parts
            first = next(i for i, part in enumerate(parts) if "{rank}" in part)
            run = Path(*parts[:first]) if first else Path(".")
            check_output_folder(run)
            if not os.access(run, os.W_OK):
                raise RouteToolError("folder is not writable", path=run, fix="choose a writable folder")
            return
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

    def _resolve_output(self) -> None:
        """Fill in ``{rank}`` (first call): detect the ranks, make the rank folder, check it."""
        if self.ranks is None:
            self.ranks = detect_ranks()
        if self._deferred_out:
            self.out = Path(self.out_template.replace("{rank}", str(self.ranks.rank)))
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._deferred_out = False
            self._check_output()

    def start(self) -> RoutingRecorder:
        """Bind the wrapper wherever the target is bound, now and in modules imported later
        (:mod:`routetool.capture.binding`), and start recording (also registers an ``atexit``
        close).

        Raises:
            RouteToolError: a bad target (with ``import_targets``: one that cannot be
                imported), or a ring that cannot be allocated on ``device``.
        """
        if self._started:
            raise RouteToolError("this recorder was already started", fix="make a new RoutingRecorder per recording")
        self._started = True
        self._bindings = Bindings(self.targets, self._make_wrapper, self._binding_error)
        self._bindings.start(import_modules=self.import_targets)
        self.stats.bindings = self._bindings.sites
        if self.device is not None:
            try:
                self._allocate(self.device)
            except BaseException:
                self._unpatch()
                raise
        if self.background:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="routetool-recorder")
        self._active = True
        atexit.register(self._atexit)
        return self

    def __enter__(self) -> RoutingRecorder:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    def _capturing(self) -> bool:
        """A CUDA graph is being captured on the current stream of the ring's device."""
        return self._ring is not None and _stream_capturing(self._ring.device)

    def _allocate(self, device: torch.device) -> None:
        """Make the ring on ``device`` (never while a graph is being captured)."""
        self._resolve_output()
        try:
            ring = ring_mod.DeviceRing(
                ring_bytes=self.ring_bytes, steps=self.ring_steps, max_layers=self.max_layers,
                num_layers=self.num_layers or 0, skip_steps=self.skip_steps, every_n_steps=self.every_n_steps,
                max_tokens=-1 if self.max_tokens is None else self.max_tokens,
                record_outputs=self.record_outputs, device=device)
        except ValueError as exc:
            raise RouteToolError(str(exc), path=self.out, fix="raise ring_mb or lower ring_steps / max_layers") from None
        self._ring = ring
        self.stats.ring_bytes = self.ring_bytes
        if self._paused:
            ring.stop()

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

    def step(self, *, interrupted: bool | None = None) -> None:
        """End the current forward step now (the next call starts a new one), then drain.

        A step boundary is also a check: the calls since the previous boundary must be a whole
        number of ``num_layers`` (an engine may run whole extra forwards in between). The first
        step that ends otherwise stops the recording (it is never written, nor is anything
        after it; a warning, and the error when recording stops). ``interrupted``: the run
        stopped inside the step (an exception), so a step short of calls is dropped, not judged;
        None: so when called while an exception propagates (a ``finally:`` after the model step).

        The end of the step is device work on the current stream, so it is also recorded
        into a graph being captured; the drain is skipped while capturing."""
        if interrupted is None:
            interrupted = sys.exc_info()[0] is not None
        with self._lock:
            if self._active and not self._paused:
                self.stats.model_steps += 1
            if self._ring is not None and self._active:
                self._ring.end_step(interrupted=interrupted)
        self.drain()

    def pause(self) -> None:
        """Stop storing steps until :meth:`resume` (device work on the current stream, so it
        also holds for graph replays); calls still launch the record kernel."""
        with self._lock:
            self._paused = True
            if self._ring is not None:
                self._ring.stop()

    def resume(self) -> None:
        """Store steps again, numbering them from 0 (``skip_steps`` and ``every_n_steps`` count
        from here): e.g. after an engine's warm-up, profile and graph-capture runs."""
        with self._lock:
            if not self._paused or self.error is not None:
                return
            self._paused = False
            if self._ring is not None:
                self._ring.restart()

    def flush(self) -> None:
        """Write everything recorded so far (complete steps) before returning: a drain that
        waits for the copies, then the writer writes the pending steps as a shard and the index
        (a host sync and a file write; not for the hot path; nothing while the current stream
        captures a graph). A process killed after ``flush()`` keeps every step recorded before it."""
        with self._lock:
            if self._capturing() or self._ring is None:
                return
            for _ in range(3):  # a snapshot after all prior work -> copies of its steps -> the writer
                self._drain(wait=True)
            self._hand_over(wait=True)
            executor = self._executor
        self._write_now(executor)

    def _write_now(self, executor: ThreadPoolExecutor | None) -> None:
        """Have the writer write its pending steps (after everything handed to it) and wait."""
        if executor is not None:
            try:
                executor.submit(self._write_pending).result()  # the writer works in order
                return
            except RuntimeError:  # at interpreter exit, thread pools refuse work before atexit runs
                pass
        self._write_pending()

    def drain(self) -> None:
        """Hand the ring's complete steps to the writer (host work on the current stream, no
        sync; nothing while the current stream captures a graph). Call it between steps when
        the model runs as CUDA-graph replays, where no recorded call runs Python."""
        with self._lock:
            if not self._capturing():
                self._drain()

    # -- the wrapper ------------------------------------------------------------------------
    def _make_wrapper(self, fn: Callable) -> Callable:
        recorder = self

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if recorder._active:
                recorder._record(args, kwargs, out)
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

    def _record(self, args: tuple, kwargs: dict, out) -> None:
        """Record one routing call (the Python side of the wrapper). Run eagerly (also while a
        CUDA graph is captured), it calls the op's host side (:meth:`record_call`) itself, without
        the dispatcher; torch.compile traces the op (:meth:`_record_traced`), and tensors of other
        classes (fake or meta tensors) go through the op too."""
        if _compiling():
            self._record_traced(args, kwargs, out)
            return
        plan_key = None
        ring = self._ring
        # the engines' call: every argument positional but is_padding
        positional = len(args) == 9 and (not kwargs or (len(kwargs) == 1 and "is_padding" in kwargs))
        pad = kwargs.get("is_padding") if positional and kwargs else None
        if ring is not None and ring.plans and positional and type(args[0]) is torch.Tensor and self.record_outputs:
            plan_key = self._record_planned(ring, args, pad, out)
            if plan_key is True:
                return
        try:
            if positional:
                g, bias = args[:2]
                params = RouterConfig.call_values(args[2:7])
            else:
                p = self._params(args, kwargs)
                g, bias, pad = p["gating_output"], p["bias"], p["is_padding"]
                params = RouterConfig.call_values(p)
            w = ids = None
            if self.record_outputs:
                w, ids = self._outputs(out, g, params[0])
            position = self._position()
            if type(g) is torch.Tensor:
                self.record_call(self._token, g, bias, pad, w, ids, position, params, plan_key=plan_key)
            else:
                if not isinstance(g, torch.Tensor) or g.dim() != 2:
                    raise RouteToolError("gating_output is not a 2-D tensor", path=self.out,
                                         fix="record a function with the seed's signature")
                torch.ops.routetool.record_routing(self._token, g, bias, pad, w, ids, self._handle, position, *params)
        except RouteToolError as exc:
            with self._lock:
                self._fail(exc)
        except Exception as exc:  # never break the recorded run
            with self._lock:
                self._fail(self._unexpected(exc))

    def _record_planned(self, ring: ring_mod.DeviceRing, args: tuple, pad, out) -> tuple | bool | None:
        """The eager hot path of an engine's call (every argument positional, outputs recorded): the
        call's plan key (the current device, the router arguments as given, and every tensor's
        dtype, shape, strides, device and 16-byte alignment: all a direct launch depends on), and,
        when the ring has a plan
        for it, the compiled record kernel launched directly. Returns True when launched, else the
        key (None when no key can be made) for the checked path to leave its plan under."""
        g, bias = args[0], args[1]
        try:
            w, ids = out
            gp, bp, wp, ip = g.data_ptr(), bias.data_ptr(), w.data_ptr(), ids.data_ptr()
            device = (self._current_device or self._find_current_device())()
            # one flat tuple (cheaper to build and hash than one per tensor); the CPU's device is -1
            if pad is None:
                pp = None
                pad_key = None
            else:
                pp = pad.data_ptr()
                pad_key = (pad.dtype, pad.shape, pad.stride(), pad.get_device())
            key = (device, args[2:7], ring.rows_per_program, ring.num_warps, ring.use_pdl,
                   g.dtype, g.shape, g.stride(), g.get_device(),
                   bias.dtype, bias.shape, bias.stride(), bias.get_device(),
                   w.dtype, w.shape, w.stride(), w.get_device(),
                   ids.dtype, ids.shape, ids.stride(), ids.get_device(), pad_key,
                   (gp & 15) | (bp & 15) << 4 | (wp & 15) << 8 | (ip & 15) << 12 | ((pp or 0) & 15) << 16)
            plan = ring.plans.get(key)
        except Exception:  # noqa: BLE001 - no key: the checked path names what is wrong
            return None
        if plan is None:
            return key
        if self.layer_fn is None and getattr(self._local, "layer", None) is None:
            position = -1  # by call order (num_layers is given: a recorder without it has a layer_fn)
        else:
            position = self._position()
            if position < 0 and self.num_layers is None:
                return key
        site, launch = plan
        with self._lock:
            if not self._active:
                return True
            try:
                launch.direct(_Driver.current_stream(device), gp, bp, pp, wp, ip, position, site)
            except Exception as exc:  # never break the recorded run
                self._fail(self._unexpected(exc))
                return True
            if time.monotonic() - self._last_drain >= self.drain_interval_s and not self._capturing():
                self._drain()
        return True

    def _find_current_device(self) -> Callable[[], int]:
        self._current_device = _current_device_function()  # (a plan exists: CUDA is initialized)
        return self._current_device

    def _record_traced(self, args: tuple, kwargs: dict, out) -> None:
        """The wrapper's recording as torch.compile traces it: only the op (layers by call order)."""
        p = self._params(args, kwargs)
        w, ids = out if self.record_outputs else (None, None)
        torch.ops.routetool.record_routing(self._token, p["gating_output"], p["bias"], p["is_padding"], w, ids,
                                           self._handle, -1, *RouterConfig.call_values(p))

    def _outputs(self, out, g, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The call's ``(topk_weights, topk_ids)``; their shapes, dtypes and devices are checked
        with the call's other tensors (:meth:`_check_call`, once per signature)."""
        try:
            w_out, ids_out = out
        except (TypeError, ValueError):
            n = int(g.shape[0]) if isinstance(g, torch.Tensor) and g.dim() == 2 else "num_tokens"
            raise RouteToolError(f"the function did not return (topk_weights [{n}, {topk}], topk_ids [{n}, {topk}])",
                                 path=self.out, tensor="topk_ids",
                                 fix="pass record_outputs=False to record inputs only") from None
        return w_out, ids_out

    def _position(self) -> int:
        """The layer position of the current call (-1: by call order)."""
        explicit = getattr(self._local, "layer", None)
        if explicit is None and self.layer_fn is not None:
            explicit = self.layer_fn()
        if explicit is None:
            if self.num_layers is None:
                raise RouteToolError("a routing call without a layer index and no num_layers to count calls",
                                     fix="give num_layers, or make layer_fn return an index for every call")
            return -1
        layer = int(explicit)
        with self._lock:
            pos = self._position_of.get(layer)
            if pos is None:
                if len(self._layers) >= self.max_layers:
                    raise RouteToolError(f"more than max_layers={self.max_layers} distinct layers were called",
                                         path=self.out, fix="raise max_layers")
                pos = len(self._layers)
                self._layers.append(layer)
                self._position_of[layer] = pos
        return pos

    # -- the op's host side ---------------------------------------------------------------------
    def record_call(self, token: torch.Tensor, g: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None,
                    w: torch.Tensor | None, ids: torch.Tensor | None, position: int, params: tuple, *,
                    plan_key: tuple | None = None) -> None:
        """The record op's host side (runs when Python runs the op: eager, compiled code, capture):
        check the call against the ring's layout and launch the record kernel. ``plan_key``: the
        wrapper's key of the call (:meth:`_record_planned`), under which its plan is kept too.

        The checks and the launch settings depend only on the call's signature (every tensor's
        dtype, shape, strides, device and alignment, the router parameters, the ring's launch
        settings): the first call of a signature runs them and leaves a plan (its site and the
        kernel's launch); later calls with it launch the compiled kernel directly
        (:mod:`routetool_kernels._dispatch`), with their own data pointers and layer position."""
        with self._lock:
            if not self._active:
                return
            try:
                self._launch(g, bias, pad, w, ids, position, params, plan_key)
            except RouteToolError as exc:
                self._fail(exc)
                return
            except Exception as exc:  # never break the recorded run
                self._fail(self._unexpected(exc))
                return
            if time.monotonic() - self._last_drain >= self.drain_interval_s and not self._capturing():
                self._drain()

    def _launch(self, g: torch.Tensor, bias: torch.Tensor, pad: torch.Tensor | None, w: torch.Tensor | None,
                ids: torch.Tensor | None, position: int, params: tuple, plan_key: tuple | None = None) -> None:
        """Launch the record kernel for one call: from its signature's plan, or checked (under the lock)."""
        ring = self._ring
        key = None
        if ring is not None and ring.device.type == "cuda":
            try:
                key, pointers, device = call_signature(
                    (g, bias, pad, w, ids), (*params, ring.rows_per_program, ring.num_warps, ring.use_pdl), True)
                plan = ring.plans.get(key)
            except Exception:  # noqa: BLE001 - no key: the checked path names what is wrong
                key = plan = None
            if plan is not None and (position >= 0 or self.num_layers is not None):
                site, launch = plan  # (plans are kept for direct launches only)
                launch.direct(_Driver.current_stream(device), *pointers, position, site)
                _keep_plan(ring, (plan_key,), plan)  # the wrapper's next call of this signature finds it by its key
                return
        if ring is None:
            if _stream_capturing(g.device):
                raise RouteToolError("the first recorded routing call is being captured into a CUDA graph, "
                                     "before the recorder has its ring", path=self.out, fix=_CAPTURED_FIRST_FIX)
            self._allocate(g.device)
            ring = self._ring
        self._check_call(g, bias, pad, w, ids, int(params[0]))
        site = self._site(params, int(g.shape[1]))
        if position < 0 and self.num_layers is None:
            raise RouteToolError("a routing call without a layer index and no num_layers to count calls "
                                 "(compiled code counts calls)", fix="give num_layers")
        launch = ring.launch(g, bias, pad, w, ids, position, site)
        if launch is not None and launch.can_direct:
            _keep_plan(ring, (key, plan_key), (site, launch))

    def _site(self, params: tuple, num_experts: int) -> int:
        """The number of the call's router parameters; the first call's are the trace's."""
        router = RouterConfig.from_call(num_experts, params)
        given = self.given_router
        if given is not None:  # the semantics beyond the call's arguments; the arguments must agree
            differ = [name for name in given.differences(router) if name not in RouterConfig.BEYOND_SEED]
            if differ:
                raise RouteToolError(
                    f"the recorded call's router ({router}) is not the router given to the recorder ({given}): "
                    f"{', '.join(differ)} differ", path=self.out, tensor="__metadata__",
                    fix="give the recorder the router the calls route with")
            router = given
        if self.router is None:
            problems = router_config_errors(router)
            if problems:
                raise RouteToolError("; ".join(problems), path=self.out, tensor="__metadata__",
                                     fix="the recorded call's parameters cannot form a trace")
            self.router = router
        elif router != self.router:
            raise RouteToolError(
                f"router parameters changed during the run ({router}; first call: {self.router})",
                path=self.out, tensor="__metadata__",
                fix="a trace holds one router configuration; record runs with different parameters separately",
            )
        return self._sites.setdefault(params, len(self._sites))

    def _check_call(self, g, bias, pad, w, ids, topk: int) -> None:
        ring = self._ring
        device = ring.device
        if g.dim() != 2 or g.dtype not in _GATING_DTYPES:
            raise RouteToolError(f"gating_output is {g.dtype} {list(g.shape)}, not a 2-D float32/bfloat16/float16 "
                                 "tensor", path=self.out, tensor="gating_output",
                                 fix="record a function with the seed's signature")
        n, num_experts = (int(s) for s in g.shape)
        if g.device != device:
            raise RouteToolError(f"gating_output is on {g.device} but the recorder's ring is on {device}",
                                 path=self.out, fix="record the calls of one device per recorder (device=...)")
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,) or bias.device != device \
                or not bias.is_floating_point():
            raise RouteToolError(f"bias is not a float tensor [{num_experts}] on {device}", path=self.out,
                                 tensor="bias", fix="record a function with the seed's signature")
        if pad is not None and (pad.dtype != torch.bool or tuple(pad.shape) != (n,) or pad.device != device):
            raise RouteToolError(f"is_padding is not a bool tensor [{n}] on {device}", path=self.out,
                                 tensor="is_padding", fix="record a function with the seed's signature")
        if self.record_outputs:
            for name, t, dtypes in (("topk_weights", w, None), ("topk_ids", ids, (torch.int32, torch.int64))):
                ok = (isinstance(t, torch.Tensor) and tuple(t.shape) == (n, topk) and t.device == device
                      and (t.is_floating_point() if dtypes is None else t.dtype in dtypes))
                if not ok:
                    raise RouteToolError(f"the function did not return {name} [{n}, {topk}] on {device}",
                                         path=self.out, tensor=name,
                                         fix="pass record_outputs=False to record inputs only")
        lay = ring.layout
        if not lay.bound:
            wdtype = w.dtype if w is not None and w.dtype in _WEIGHT_DTYPES else torch.float32
            try:
                ring.bind(num_experts, topk, g.dtype, wdtype)
            except ValueError as exc:
                raise RouteToolError(str(exc), path=self.out, fix="raise ring_mb") from None
            self.stats.ring_rows = ring.layout.rows
        elif g.dtype != lay.gating_dtype:
            raise RouteToolError(f"gating_output changed dtype from {lay.gating_dtype} to {g.dtype}", path=self.out,
                                 tensor="gating_output", fix="record runs of one dtype")

    # -- draining (the model's thread, no graph capture underway) --------------------------------
    def _drain(self, final: bool = False, wait: bool = False) -> None:
        """Move the ring's complete steps towards the writer (under the lock): hand landed copies
        to the writer; turn a landed snapshot into copies of its complete steps (``final``: every
        step it shows, for a snapshot taken after the device stopped); take the next snapshot.
        ``wait``: wait for copies and snapshot instead of leaving them for the next drain."""
        ring = self._ring
        if ring is None:
            return
        self._last_drain = time.monotonic()
        if self._stop_pending:
            ring.stop()
            self._stop_pending = False
        self._hand_over(wait)
        snap = self._snapshot
        if snap is not None and (wait or snap.ready()):
            snap.wait()
            self._snapshot = None
            state = snap.values()
            self._update_stats(state)
            # (a drain that waits, flush's and close's, copies whatever the writer's backlog)
            if final or wait or self._backlog + len(self._copies) < _MAX_COPIES_IN_FLIGHT:
                if final:
                    self._find_interrupted(state)
                copy = ring.copy_out(state, *self._released, final, release=False)
                if copy is not None:
                    # taken over first, released after: an interruption in between copies the steps again
                    copy.state = state
                    self._copies.append(copy)
                    self._released = (copy.rows_end, copy.first_slot + int(copy.steps.shape[0]))
                    ring.release(*self._released)
                    self.stats.drains += 1
        if self._snapshot is None and not final:
            self._snapshot = ring.snapshot()
        shard = self._shard
        if (shard is not None and not self._age_write_queued and self._executor is not None
                and time.monotonic() - shard.started >= self.shard_s):
            self._age_write_queued = True  # the pending steps are old enough: write them (on the writer)
            try:
                self._executor.submit(self._write_pending)
            except RuntimeError:
                pass

    def _find_interrupted(self, state: list[int]) -> None:
        """At close: a recorded step that the run stopped inside (fewer calls than ``num_layers``,
        or than the step before when calls are numbered explicitly) is dropped, not written."""
        S = ring_mod
        calls = state[S.STATE_CALLS_IN_STEP]
        expect = self.num_layers or state[S.STATE_LAST_STEP_CALLS]
        if 0 < calls < expect and state[S.STATE_CUR_SLOT] > 0 and state[S.STATE_CUR_SLOT] == state[S.STATE_HEAD_STEPS]:
            self._interrupted.add(state[S.STATE_STEPS_SEEN] - 1)

    def _write_drained(self) -> None:
        """At close, before the ring's last steps: hand every landed copy to the writer and have it
        write its pending steps, so that a kill while closing loses at most what the ring holds."""
        with self._lock:
            if self._ring is None or self._capturing():
                return
            try:
                self._drain(wait=True)
                self._hand_over(wait=True)
            except Exception:  # noqa: BLE001 - a broken device: the final drain reports it
                return
            executor = self._executor
        self._write_now(executor)

    def _final_drain(self) -> None:
        """Everything the ring holds, synchronously (at close)."""
        ring = self._ring
        if ring is None or self._capturing():
            return
        self._drain(wait=True)  # what the last snapshot showed, as during the run
        ring.stop()  # nothing is recorded after this: the next snapshot shows the end
        self._stop_pending = False
        self._snapshot = ring.snapshot()
        self._drain(final=True, wait=True)
        self._drain(final=True, wait=True)

    def _update_stats(self, state: list[int]) -> None:
        S = ring_mod
        st = self.stats
        st.calls_seen = state[S.STATE_CALLS_SEEN]
        st.calls_recorded = state[S.STATE_CALLS_RECORDED]
        st.steps_seen = state[S.STATE_STEPS_SEEN]
        st.steps_recorded = state[S.STATE_HEAD_STEPS]
        st.steps_dropped = state[S.STATE_DROPPED_FULL]
        st.steps_too_large = state[S.STATE_DROPPED_LARGE]
        st.calls_dropped = state[S.STATE_CALLS_DROPPED]
        st.tokens_recorded = state[S.STATE_TOKENS]
        if state[S.STATE_STOPPED] == S.STOPPED_BUDGET and self.stopped_by is None:
            self.stopped_by = "max_tokens"
        if state[S.STATE_MISMATCH_STEP] and self._refused_from is None:
            self._refuse(state)

    def _refuse(self, state: list[int]) -> None:
        """The device found a step whose calls disagree with ``num_layers``: stop recording, write
        nothing from that step on, warn once now and raise when recording stops (under the lock)."""
        S = ring_mod
        step = state[S.STATE_MISMATCH_STEP] - 1
        self._refused_from = step
        layers = f"num_layers={self.num_layers}"
        if state[S.STATE_MISMATCH_KIND] == S.MISMATCH_ROWS:
            what = (f"call {state[S.STATE_MISMATCH_CALLS]} of step {step} routes {state[S.STATE_MISMATCH_ROWS]} rows, "
                    f"the step's first call {state[S.STATE_MISMATCH_STEP_ROWS]}: the calls of one step route the same "
                    f"tokens, so counting {layers} calls per step puts calls into steps and layers they do not "
                    "belong to")
        else:
            what = (f"step {step} ended with {state[S.STATE_MISMATCH_CALLS]} routing call(s) since the last whole "
                    f"step of {layers}: the model routes another number of calls per step")
        error = RouteToolError(f"{what}; recording stopped at step {step}, nothing from it on is written",
                               path=self.out, tensor="num_layers",
                               fix="give the model's MoE layers per forward step (ROUTETOOL_CAPTURE_LAYERS for the "
                                   "vLLM plugin), or layer indexes (layer_fn / rec.layer)")
        self._fail(error)
        self.refusal = {"step": step, "reason": what}
        warnings.warn(f"routetool recorder: {error}", RuntimeWarning, stacklevel=2)
        if self._written and self._executor is not None:  # mark the trace now, not only at close
            try:
                self._executor.submit(self._write_index)
            except RuntimeError:
                pass

    refusal: dict | None = None
    """``{"step": N, "reason": ...}`` once a step's calls disagreed with ``num_layers``."""

    def _hand_over(self, wait: bool) -> None:
        """Hand the landed copies (all of them with ``wait``) to the writer, oldest first. A copy
        leaves the queue only once handed over, so an interruption in between (Ctrl-C lands
        between any two lines) hands it over again at the next drain; the writer takes each copy
        once (:meth:`_consume`)."""
        while self._copies and (wait or self._copies[0].ready()):
            copy = self._copies[0]
            copy.wait()
            self._submit(copy)
            self._copies.popleft()

    def _submit(self, copy: ring_mod.RingCopy) -> None:
        self._backlog += 1
        if self._executor is not None:
            try:
                self._executor.submit(self._consume, copy)
                return
            except RuntimeError:  # at interpreter exit, thread pools refuse work before atexit runs
                pass
        self._consume(copy)

    # -- the writer (no CUDA calls) -----------------------------------------------------------------
    def _consume(self, copy: ring_mod.RingCopy) -> None:
        """Turn a landed copy into pending steps; write a shard whenever ``shard_mb`` are pending.

        A call whose bias differs from its layer's first recorded bias (bit for bit) ends the
        recording there: a trace holds one bias per layer; the steps before it are kept. A copy
        handed over twice (:meth:`_hand_over`) is taken once."""
        try:
            if copy.taken:
                return
            copy.taken = True
            copy.rows = {name: _pageable(t) for name, t in copy.rows.items()}  # free the pinned copies now
            for step in self._ring.decode(copy):
                if self._bias_changed:
                    break
                why = self._drop_reason(step)
                if why is not None:
                    with self._lock:
                        if len(self._not_written) < _MAX_NOTED_STEPS:
                            self._not_written.append({"step": step.number, "why": why})
                        self.stats.steps_not_written += 1
                    continue
                for call in step.calls:
                    first = self._bias.setdefault(call.position, call.bias)
                    if not torch.equal(first.view(torch.int32), call.bias.view(torch.int32)):
                        layer = self._layers[call.position]
                        counted = (f" (calls are counted into layers: a num_layers={self.num_layers} that is not the "
                                   "model's MoE layers per step shows so too)" if self.num_layers else "")
                        with self._lock:
                            self._bias_changed = True
                            self._fail(RouteToolError(
                                f"the bias of layer {layer} changed at step {step.number}{counted}; the steps before "
                                "it are kept", path=self.out, tensor=f"layers.{layer}.bias",
                                fix="a trace holds one bias per layer: record runs with another bias separately; give "
                                    "the model's MoE layers per step"), from_writer=True)
                        break
                if self._bias_changed or not step.calls:
                    continue
                if self._shard is None:
                    self._shard = _Shard(number=self._shard_number, started=time.monotonic())
                    self._shard_number += 1
                self._shard.steps.append(step)
                nbytes = sum(_call_bytes(c) for c in step.calls)
                self._shard.nbytes += nbytes
                self.stats.bytes_recorded += nbytes
                if self._shard.nbytes >= self.shard_bytes or time.monotonic() - self._shard.started >= self.shard_s:
                    self._write_pending()
        except Exception as exc:  # never break the recorded run
            with self._lock:
                self._fail(self._unexpected(exc), from_writer=True)
        finally:
            with self._lock:
                self._backlog -= 1

    _bias_changed = False

    def _drop_reason(self, step: ring_mod.RingStep) -> str | None:
        """Why a drained step must not be written (None: it is written)."""
        if step.flags == ring_mod.STEP_INTERRUPTED or step.number in self._interrupted:
            return "interrupted"  # the run stopped inside it: some layers lack it
        if step.flags == ring_mod.STEP_MISMATCHED or (self._refused_from is not None
                                                      and step.number >= self._refused_from):
            return "calls disagree with num_layers"
        return None

    def _write_pending(self) -> None:
        """Write the pending steps as the next shard, make it durable, then list it in the index
        (the writer's thread, or the model's at close). Each file is written aside and renamed into
        place, so a kill at any moment leaves every listed shard whole."""
        self._age_write_queued = False
        shard, self._shard = self._shard, None
        if shard is None or not shard.steps:
            return
        path = shard_path(self.out, shard.number)
        try:
            if self._write_failed:  # the disk failed before: keep the shards written, stop writing
                return
            layers = self._shard_layers(shard)
            write_trace(path, self._shard_meta(shard), layers, force=self.force)
            _fsync(path)  # on disk before the index lists it
            first, last = shard.steps[0], shard.steps[-1]
            drops = last.drops_before - self._last_drops
            self._last_drops = last.drops_before
            entry = {"path": path.name, "size_bytes": path.stat().st_size, "num_steps": len(shard.steps),
                     "first_step": first.number, "last_step": last.number, "dropped_steps": drops}
            with self._lock:
                self._written.append(entry)
                self.stats.shards_written += 1
                self.stats.steps_written += len(shard.steps)
            self._write_index()
        except RouteToolError as exc:
            with self._lock:
                self._write_failed = True
                self._fail(exc, from_writer=True)
        except Exception as exc:
            with self._lock:
                self._write_failed = True
                self._fail(RouteToolError(f"cannot write shard ({type(exc).__name__}: {exc})", path=path,
                                          fix="check free disk space and permissions"), from_writer=True)

    _write_failed = False

    def _write_index(self) -> None:
        """Rewrite the index of a recording still running (``complete: false``; why it stops, once
        known), listing every shard written so far."""
        with self._lock:
            written = list(self._written)
            extra = self._index_extra()
            stopped_by = f"recorder error: {self.error}" if self.error is not None else None
        if written:
            write_index(self.out, written, complete=False, stopped_by=stopped_by, extra=extra)
            _fsync(self.out)

    def _shard_layers(self, shard: _Shard) -> dict[int, LayerArrays]:
        by_pos: dict[int, list[ring_mod.RingCall]] = {}
        for step in shard.steps:
            for call in step.calls:
                by_pos.setdefault(call.position, []).append(call)
        layers: dict[int, LayerArrays] = {}
        for pos, calls in sorted(by_pos.items(), key=lambda kv: self._layers[kv[0]]):
            any_pad = any(c.padding is not None for c in calls)
            with_outputs = all(c.ids is not None for c in calls)
            padding = None
            if any_pad:  # calls without a mask are unpadded
                padding = torch.cat([c.padding if c.padding is not None else
                                     torch.zeros(c.gating.shape[0], dtype=torch.bool) for c in calls])
            sizes = [int(c.gating.shape[0]) for c in calls]
            layers[self._layers[pos]] = LayerArrays(
                gating_output=torch.cat([c.gating for c in calls]),
                bias=self._bias[pos].clone(),
                is_padding=padding,
                step_offsets=torch.tensor([0] + sizes, dtype=torch.int64).cumsum(0),
                topk_ids=torch.cat([c.ids for c in calls]) if with_outputs else None,
                topk_weights=torch.cat([c.weights for c in calls]) if with_outputs else None,
            )
        return layers

    def _shard_meta(self, shard: _Shard) -> TraceMeta:
        extra = {
            "capture": f"routetool.capture.recorder ({self.target}; device ring)",
            "sampling": f"every_n_steps={self.every_n_steps} skip_steps={self.skip_steps} max_tokens={self.max_tokens}",
            "shard": str(shard.number),
            "first_step": str(shard.steps[0].number),
            "last_step": str(shard.steps[-1].number),
        }
        if self.ranks is not None:
            extra.update(self.ranks.metadata())
        if self.record_outputs:  # the router's own weights; raw ones named as capture hf names them
            extra["weights_semantics"] = "unnormalized" if self.router.norm_topk_prob is False else "renormalized"
        return TraceMeta(model=self.model, router=self.router, provenance=self.provenance, extra=extra)

    def _index_extra(self) -> dict:
        st = self.stats
        extra: dict[str, object] = {"created_by": "routetool.capture.recorder", "target": self.target}
        if self.ranks is not None:
            extra["ranks"] = self.ranks.as_dict()
        extra["recording"] = {
            "calls_seen": st.calls_seen, "steps_seen": st.steps_seen, "steps_recorded": st.steps_recorded,
            "steps_written": st.steps_written, "dropped_steps": st.steps_dropped,
            "dropped_steps_too_large": st.steps_too_large, "dropped_calls": st.calls_dropped,
            "tokens_recorded": st.tokens_recorded, "ring_bytes": st.ring_bytes, "ring_rows": st.ring_rows,
            "bindings": list(st.bindings), "model_steps": st.model_steps,
            "sampling": {"every_n_steps": self.every_n_steps, "skip_steps": self.skip_steps,
                         "max_tokens": self.max_tokens},
        }
        recording = extra["recording"]
        recording["steps_not_written"] = st.steps_not_written
        if self._not_written:
            recording["not_written"] = list(self._not_written)
        if self.refusal is not None:
            recording["refused"] = dict(self.refusal)
        if self._written:  # shards hold whole steps: the last one written is the last complete step
            extra["last_complete_step"] = self._written[-1]["last_step"]
        return extra

    def _unexpected(self, exc: Exception) -> RouteToolError:
        """An exception that is no :class:`RouteToolError` (a recorder bug), as the recording's error."""
        return RouteToolError(f"recording failed ({type(exc).__name__}: {exc})", path=self.out,
                              fix="report this as a routetool bug")

    def _fail(self, exc: RouteToolError, from_writer: bool = False) -> None:
        """A problem of the recorder: stop recording, keep what was written, raise at close
        (under the lock). The device stops now (stream-ordered) from the model's thread outside
        capture; from the writer or inside capture, at the next drain."""
        if self.error is None:
            self.error = exc
            self.stopped_by = f"recorder error: {exc}"
        self._active = False
        self._stop_pending = True
        if self._ring is not None and not from_writer and not self._capturing() and not _compiling():
            self._ring.stop()
            self._stop_pending = False

    # -- stopping ------------------------------------------------------------------------------
    def _binding_error(self, exc: RouteToolError) -> None:
        """A target found bad when the engine imported its module (never raised into the import)."""
        with self._lock:
            self._fail(exc, from_writer=True)

    def _unpatch(self) -> None:
        if self._bindings is None:
            return
        for site in self._bindings.restore():
            warnings.warn(f"routetool recorder: {site} was replaced by someone else while recording; left as it is",
                          stacklevel=3)

    def bindings_summary(self) -> str:
        """Where the recorder can see calls from, in words (e.g. ``3 bindings: m.f, ...``)."""
        sites = list(self.stats.bindings)
        waiting = self._bindings.waiting if self._bindings is not None else []
        text = f"{len(sites)} binding{'s' if len(sites) != 1 else ''}"
        if sites:
            text += ": " + ", ".join(sites)
        if waiting:
            text += f"; never imported: {', '.join(waiting)}"
        return text

    def _record_nothing(self, complete: bool, stopped_by: str) -> None:
        """Model steps ran and none called the target: say so in the index (a
        ``"recorded": "nothing"`` record with no shards), never end as an empty success."""
        st = self.stats
        self.recorded_nothing = (
            f"recorded nothing: {st.model_steps} model step{'s' if st.model_steps != 1 else ''} ran and none called "
            f"{', '.join(self.targets)} ({self.bindings_summary()}; {st.calls_seen} call{'s' if st.calls_seen != 1 else ''} "
            "before the first step)")
        try:
            self._resolve_output()
            extra = self._index_extra()
            extra["recorded"] = "nothing"
            extra["recorded_nothing"] = self.recorded_nothing
            write_index(self.out, [], complete=complete, stopped_by=stopped_by, extra=extra)
        except RouteToolError as exc:
            if self.error is None:
                self.error = exc

    def _atexit(self) -> None:
        try:
            self.close()
        except RouteToolError as exc:
            warnings.warn(f"routetool recorder: {exc}", stacklevel=1)

    def close(self, exc: BaseException | None = None) -> None:
        """Stop recording: restore the originals, write what the ring holds, finish the index.

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
        # a KeyboardInterrupt that lands between taking the lock and entering the block that
        # releases it leaves the lock held by this thread (bpo-29988); nothing else holds it here,
        # and the writer needs it to finish
        while self._lock._is_owned():
            self._lock.release()
        self._write_drained()  # what was drained goes to disk first: a kill while closing loses only the ring's steps
        with self._lock:
            self._active = False
            try:
                self._final_drain()
            except Exception as drain_error:  # a broken device: keep what was written
                if self.error is None:
                    self.error = RouteToolError(f"cannot drain the ring ({type(drain_error).__name__}: "
                                                f"{drain_error})", path=self.out, fix="report this as a routetool bug")
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            self._write_pending()
        if exc is not None:
            stopped_by = f"error: {type(exc).__name__}: {exc}"
        elif self.error is not None:
            stopped_by = f"recorder error: {self.error}"
        else:
            stopped_by = self.stopped_by or "exit"
        complete = exc is None and self.error is None
        if not self._written and self.stats.model_steps and not self.stats.steps_seen:
            self._record_nothing(complete, stopped_by)
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
        if self.recorded_nothing is not None:
            if not self.require_calls:
                return
            raise RouteToolError(self.recorded_nothing, path=self.out, fix=_NOTHING_FIX)
        if self.stats.calls_seen == 0 and not self.require_calls and not self._written:
            return
        if self.stats.calls_seen == 0:
            raise RouteToolError(f"the recorder saw no call of {', '.join(self.targets)}", path=self.out,
                                 fix=_NOTHING_FIX)
        if not self._written:
            raise RouteToolError(
                f"recorded no step ({self.stats.calls_seen} calls in {self.stats.steps_seen} steps seen; "
                f"skip_steps={self.skip_steps}, every_n_steps={self.every_n_steps}, max_tokens={self.max_tokens}, "
                f"dropped: {self.stats.steps_dropped} (ring full), {self.stats.steps_too_large} (larger than the "
                f"ring))",
                path=self.out, fix="lower skip_steps/every_n_steps, raise max_tokens above one step's tokens, or "
                                   "raise ring_mb")


def _keep_plan(ring: ring_mod.DeviceRing, keys: tuple, plan: tuple) -> None:
    """Keep a launch plan under each key that is not None (at most :data:`_MAX_PLANS`: one more
    empties the ring's plans, so a call is checked again, never launched wrong)."""
    for key in keys:
        if key is not None:
            if len(ring.plans) >= _MAX_PLANS:
                ring.plans.clear()
            ring.plans[key] = plan


def _fsync(path: Path) -> None:
    """Flush ``path``'s data (and the folder entry that names it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        fd = os.open(path.parent if str(path.parent) else ".", os.O_RDONLY)
    except OSError:  # a folder that cannot be opened (some platforms): the data are on disk
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pageable(t: torch.Tensor) -> torch.Tensor:
    """``t`` in ordinary host memory (a copy if ``t`` is pinned)."""
    if not t.is_pinned():
        return t
    out = torch.empty(t.shape, dtype=t.dtype)
    out.copy_(t)
    return out


def _call_bytes(call: ring_mod.RingCall) -> int:
    return sum(t.numel() * t.element_size() for t in (call.gating, call.padding, call.ids, call.weights)
               if t is not None)
