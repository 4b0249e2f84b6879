"""The vLLM plugin: record the routing call site in every engine and worker process.

vLLM calls each function of the entry-point group ``vllm.general_plugins`` in every process it
starts (API server, engine core, each GPU worker), before the model class is imported
(``vllm/plugins/__init__.py``, ``load_general_plugins``). routetool's entry point
(``routetool_capture`` in pyproject.toml) is :func:`register`. It does nothing unless
``ROUTETOOL_CAPTURE_DIR`` names a run folder; then, in each process, it starts a
:class:`~routetool.capture.recorder.RoutingRecorder` that writes ``<DIR>/rank-<r>/trace.json``
(+ shards), ``r`` being the process's global rank, with its DP/TP/EP/PP ranks and the world
size in the metadata (:mod:`routetool.capture.ranks`, from vLLM's parallel state).

What it records, with no further option, in vLLM 0.33: ``fused_musespark1x_routing``, defined
in ``vllm.models.muse_spark.common.ops.fused_routing`` and called from its two call sites,
``vllm.models.muse_spark.common.moe`` (``MuseSpark1xRouter._compute_routing``) and
``vllm.models.muse_spark.nvidia.model`` (the MegaMoE ``route()``, into the experts' buffers,
with ``is_padding``), each of which binds it with a from-import. Nothing is imported when the
plugin loads: the recorder binds its wrapper in every module that holds the function as the
engine imports them (:mod:`routetool.capture.binding`), whichever is imported first.

Steps: the recorder is paused until the first model step, so the calls of vLLM's warm-up,
memory profile and CUDA-graph capture reach the record op (graphs are captured with it) but
are not stored. The step hook wraps ``execute_model`` of both GPU model runners of vLLM 0.33,
``vllm.v1.worker.gpu.model_runner:GPUModelRunner`` (model runner V2, the default) and
``vllm.v1.worker.gpu_model_runner:GPUModelRunner`` (V1, ``VLLM_USE_V2_MODEL_RUNNER=0``), when
their modules are imported. The first real step resumes the recorder; after every step the
recorder ends the step and drains the ring. V2 runs its dummy batches through
``execute_model(dummy_run=True)``: those never resume the recorder, and once it runs they end a
step of their own (a data-parallel rank's idle batch is a forward pass of its own).

Workers forked by multiprocessing from a process that loaded the plugin (vLLM's default
``VLLM_WORKER_MULTIPROC_METHOD=fork``) go on with the inherited recording and finish it from
multiprocessing's exit finalizers (they end with ``os._exit``, which runs no ``atexit`` handler).

At exit each process that recorded prints one line (steps written, calls seen, model steps,
the bindings of the function). A process that ran model steps and saw no routing call after
the first says so on stderr and writes ``rank-<r>/trace.json`` as a ``"recorded": "nothing"``
record (``routetool info`` reads it as that); processes that never ran a model step (API
server, engine core) stay silent.

A bad option, or a recorder that cannot start, never stops vLLM (whose plugin loader lets a
plugin's exception end the process): the plugin prints one ``routetool: ...`` line naming the
variable and the fix to stderr, and recording stays off in that process. Options, all by
environment (vLLM gives plugins no other channel; an unknown ``ROUTETOOL_CAPTURE_*`` name is
an error, so a typo cannot pass silently):

======================================  ======================================================
variable                                meaning (default)
======================================  ======================================================
``ROUTETOOL_CAPTURE_DIR``               the run folder (created if its parent exists); unset:
                                        the plugin does nothing. The plugin makes its
                                        ``rank-<r>`` folders: ``{rank}`` in it is refused
``ROUTETOOL_CAPTURE_TARGET``            ``module:function`` to record (vLLM 0.33's
                                        ``vllm.models.muse_spark.common.ops.fused_routing:``
                                        ``fused_musespark1x_routing``); other engines
``ROUTETOOL_CAPTURE_TARGETS``           more ``module:function`` targets, comma-separated
                                        (further functions; bindings of a target are found
                                        without naming them)
``ROUTETOOL_CAPTURE_LAYERS``            MoE layers per step: ``58`` (layers 0-57), ``3-60``
                                        (layers 3 to 60), or ``3,5,7``; at most 1024; required
``ROUTETOOL_CAPTURE_EVERY``             record one step in N (1)
``ROUTETOOL_CAPTURE_SKIP``              steps to skip first (0)
``ROUTETOOL_CAPTURE_MAX_TOKENS``        stop before the step that would take the token rows
                                        per layer over this budget (none)
``ROUTETOOL_CAPTURE_OUTPUTS``           ``1``: also record topk_ids/topk_weights; ``0``: inputs
                                        only (1)
``ROUTETOOL_CAPTURE_RING_MB``           device ring per process, MiB (256)
``ROUTETOOL_CAPTURE_RING_STEPS``        step slots of the ring (256)
``ROUTETOOL_CAPTURE_SHARD_MB``          write a shard per this many MB (256)
``ROUTETOOL_CAPTURE_STEP_HOOK``         ``module:Class.method`` run once per model step (imported
                                        at start; an error if missing), or ``none`` (record
                                        from the first call, drain only when a call runs
                                        Python) (both model runners' ``execute_model``)
``ROUTETOOL_CAPTURE_MODEL``             the traces' model name
``ROUTETOOL_CAPTURE_FORCE``             ``1``: replace an earlier recording in the folder (0)
======================================  ======================================================
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from routetool.errors import RouteToolError, printable
from routetool.numtext import parse_float, parse_int

PREFIX = "ROUTETOOL_CAPTURE_"
DIR = PREFIX + "DIR"
DEFAULT_STEP_HOOKS = (
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",  # model runner V2 (vLLM 0.33's default)
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",  # V1 (VLLM_USE_V2_MODEL_RUNNER=0)
)
"""The per-step methods hooked by default, when (and if) the engine imports their modules."""
OPTIONS = ("DIR", "TARGET", "TARGETS", "LAYERS", "EVERY", "SKIP", "MAX_TOKENS", "OUTPUTS", "RING_MB", "RING_STEPS",
           "SHARD_MB", "STEP_HOOK", "MODEL", "FORCE")
MAX_LAYERS = 1024
"""The most MoE layers per step ``ROUTETOOL_CAPTURE_LAYERS`` may name."""
_MAX_INT = 2**62  # counts and budgets are device int64 words
_MAX_MB = float(2**20)  # 1 TiB


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's options, read from the environment by :func:`config_from_env`.

    ``step_hooks``: ``module:Class.method`` per-step methods (empty: none);
    ``step_hook_given``: named by ``ROUTETOOL_CAPTURE_STEP_HOOK`` (then it must exist).
    """

    run_dir: Path
    target: str | None
    targets: tuple[str, ...]
    layer_ids: tuple[int, ...]
    every_n_steps: int = 1
    skip_steps: int = 0
    max_tokens: int | None = None
    record_outputs: bool = True
    ring_mb: float = 256.0
    ring_steps: int = 256
    shard_mb: float = 256.0
    step_hooks: tuple[str, ...] = DEFAULT_STEP_HOOKS
    step_hook_given: bool = False
    model: str = ""
    force: bool = False


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    value = parse_int(text)
    if value is None or value < minimum or value > _MAX_INT:
        raise RouteToolError(f"{PREFIX}{name}={text!r} is not an integer from {minimum} to 2**62",
                             fix=f"e.g. {PREFIX}{name}={max(minimum, 1)}")
    return value


def _mb(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    value = parse_float(text)
    if value is None or not 0 < value <= _MAX_MB:
        raise RouteToolError(f"{PREFIX}{name}={text!r} is not a size in MiB > 0 (at most 1 TiB)",
                             fix=f"e.g. {PREFIX}{name}=256")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    if text not in ("0", "1"):
        raise RouteToolError(f"{PREFIX}{name}={text!r} is neither 0 nor 1", fix=f"{PREFIX}{name}=1 or 0")
    return text == "1"


def parse_layers(text: str) -> tuple[int, ...]:
    """``58`` -> layers 0..57; ``3-60`` -> 3..60; ``3,5,7`` -> those (distinct, >= 0); at most
    :data:`MAX_LAYERS` layers, checked before anything is allocated.

    Raises:
        RouteToolError: anything else.
    """
    fix = f"{PREFIX}LAYERS=58 (layers 0-57), =3-60 (layers 3 to 60) or =3,5,7"
    lo, dash, hi = text.partition("-")
    if dash:
        a, b = parse_int(lo), parse_int(hi)
        if a is None or b is None or a < 0 or b < a:
            raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a range of layers FIRST-LAST", fix=fix)
        _check_layer_count(text, b - a + 1, fix)
        return tuple(range(a, b + 1))
    if "," in text:
        parts = text.split(",")
        _check_layer_count(text, len(parts), fix)
        ids = [parse_int(part) for part in parts]
        if any(i is None or i < 0 or i > _MAX_INT for i in ids) or len(set(ids)) != len(ids):
            raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a list of distinct layer indexes", fix=fix)
        return tuple(ids)
    count = parse_int(text)
    if count is None or count < 1:
        raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a layer count, range or list", fix=fix)
    _check_layer_count(text, count, fix)
    return tuple(range(count))


def _check_layer_count(text: str, count: int, fix: str) -> None:
    if count > MAX_LAYERS:
        raise RouteToolError(f"{PREFIX}LAYERS={text!r} names {count} MoE layers per step, more than {MAX_LAYERS}",
                             fix=fix)


def config_from_env(env: Mapping[str, str] | None = None) -> PluginConfig | None:
    """The plugin's options, or None when ``ROUTETOOL_CAPTURE_DIR`` is unset or empty.

    Raises:
        RouteToolError: an unknown ``ROUTETOOL_CAPTURE_*`` variable, a missing or malformed
            value (naming the variable and the fix).
    """
    env = os.environ if env is None else env
    folder = env.get(DIR, "")
    if not folder:
        return None
    unknown = sorted(k for k in env if k.startswith(PREFIX) and k[len(PREFIX):] not in OPTIONS)
    if unknown:
        raise RouteToolError(f"{unknown[0]} is not a routetool capture option",
                             fix="known: " + ", ".join(PREFIX + o for o in OPTIONS))
    if "{rank}" in folder:
        raise RouteToolError(f"{DIR}={folder!r} holds {{rank}}: the plugin makes the rank-<r> folders in the run "
                             "folder itself", fix=f"set {DIR} to the run folder, without {{rank}}")
    layers = env.get(PREFIX + "LAYERS", "")
    if not layers:
        raise RouteToolError(f"{PREFIX}LAYERS is not set: the recorder needs the MoE layers of a forward step",
                             fix=f"e.g. {PREFIX}LAYERS=3-60 for a model whose layers 3 to 60 are MoE layers")
    hook = env.get(PREFIX + "STEP_HOOK", "")
    targets = tuple(t for t in env.get(PREFIX + "TARGETS", "").split(",") if t)
    return PluginConfig(
        run_dir=Path(folder),
        target=env.get(PREFIX + "TARGET") or None,
        targets=targets,
        layer_ids=parse_layers(layers),
        every_n_steps=_int(env, "EVERY", 1, 1),
        skip_steps=_int(env, "SKIP", 0, 0),
        max_tokens=_int(env, "MAX_TOKENS", None, 1),
        record_outputs=_flag(env, "OUTPUTS", True),
        ring_mb=_mb(env, "RING_MB", 256.0),
        ring_steps=_int(env, "RING_STEPS", 256, 1),
        shard_mb=_mb(env, "SHARD_MB", 256.0),
        step_hooks=() if hook == "none" else ((hook,) if hook else DEFAULT_STEP_HOOKS),
        step_hook_given=bool(hook) and hook != "none",
        model=env.get(PREFIX + "MODEL", ""),
        force=_flag(env, "FORCE", False),
    )


_RECORDER = None
"""The recorder this process's :func:`register` started (one per process)."""
_SESSION: _Session | None = None


def _say(text: str) -> None:
    """One line on stderr, escaped (a path may hold a newline or an escape sequence)."""
    print(printable(f"routetool: {text}"), file=sys.stderr, flush=True)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: start recording in this process if
    ``ROUTETOOL_CAPTURE_DIR`` is set (see the module docstring). Called again in the same
    process, it does nothing.

    Never raises (vLLM's plugin loader would let the exception end the serving process): bad
    options, a run folder whose parent is missing, an explicit step hook that cannot be found,
    or any other failure to start are one ``routetool: ...`` line on stderr, and this process
    records nothing.
    """
    global _RECORDER, _SESSION
    if _RECORDER is not None:
        return
    try:
        config = config_from_env()
        if config is None:
            return
        _SESSION = _Session(config)
        _RECORDER = _SESSION.recorder
    except RouteToolError as exc:
        _say(f"{exc}; recording is off in this process (pid {os.getpid()})")
    except Exception as exc:  # never stop the engine for a recording
        _say(f"recording could not start ({type(exc).__name__}: {exc}); recording is off in this process "
             f"(pid {os.getpid()}) (report this as a routetool bug)")


def stop() -> None:
    """Stop this process's recording now (as at exit): restore the engine's functions and
    methods, finish the trace, print the exit line. Nothing happens without a recording."""
    global _RECORDER, _SESSION
    session, _SESSION, _RECORDER = _SESSION, None, None
    if session is not None:
        session.stop()


class _Session:
    """One process's recording: the recorder, its step hooks, the exit line."""

    def __init__(self, config: PluginConfig):
        from routetool.capture.recorder import DEFAULT_TARGET, RoutingRecorder

        try:
            config.run_dir.mkdir(exist_ok=True)
        except OSError as exc:
            raise RouteToolError(f"cannot make the run folder ({exc.strerror or exc})", path=config.run_dir,
                                 fix=f"set {DIR} to a folder whose parent exists and is writable") from None
        given = _resolve_hook(config.step_hooks[0]) if config.step_hook_given else None
        self.run_dir = config.run_dir
        self.recorder = RoutingRecorder(
            config.run_dir / "rank-{rank}" / "trace.json", target=config.target or DEFAULT_TARGET,
            targets=config.targets, num_layers=len(config.layer_ids), layer_ids=config.layer_ids,
            every_n_steps=config.every_n_steps, skip_steps=config.skip_steps, max_tokens=config.max_tokens,
            record_outputs=config.record_outputs, ring_mb=config.ring_mb, ring_steps=config.ring_steps,
            shard_mb=config.shard_mb, model=config.model, force=config.force,
            provenance=f"recorded by routetool's vLLM plugin (pid {os.getpid()}); options: "
                       + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(PREFIX)),
            paused=bool(config.step_hooks), require_calls=False, import_targets=False,
        )
        self.recorder.start()
        self.hooks = _StepHooks(self.recorder)
        self._cancel: list[Callable[[], None]] = []
        if given is not None:
            self.hooks.install(*given)
        else:
            from routetool.capture.binding import when_imported

            for spec in config.step_hooks:
                module_name, _, qualname = spec.partition(":")
                self._cancel.append(when_imported(module_name, functools.partial(self._hook_module, qualname)))
        self._stopped = False
        atexit.register(self.stop)  # runs before the recorder's own (atexit is last in, first out)
        import multiprocessing.util

        multiprocessing.util.register_after_fork(self, _Session._after_fork)
        _say(f"recording {self.recorder.target} into {config.run_dir}/rank-<rank>/ (pid {os.getpid()})")

    @staticmethod
    def _after_fork(session: _Session) -> None:
        """In a process forked by multiprocessing from one that loaded the plugin (vLLM forks its
        workers from the engine core by default, ``VLLM_WORKER_MULTIPROC_METHOD=fork``, and their
        ``load_general_plugins`` then does nothing): the session goes on in the child. Such a
        child ends with ``os._exit``, which runs no ``atexit`` handler, only multiprocessing's
        finalizers: stop there."""
        import multiprocessing.util

        multiprocessing.util.Finalize(session, session.stop, exitpriority=100)

    def _hook_module(self, qualname: str, module) -> None:
        found = _owner(module, qualname)
        if found is not None:
            self.hooks.install(*found)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        for cancel in self._cancel:
            cancel()
        self.hooks.uninstall()
        rec = self.recorder
        try:
            rec.close()
        except RouteToolError as exc:
            _say(str(exc))
            return
        except Exception as exc:  # at exit: one line, never a traceback in the engine's shutdown
            _say(f"recording failed at exit ({type(exc).__name__}: {exc}) (report this as a routetool bug)")
            return
        st = rec.stats
        if rec.recorded_nothing is not None:
            _say(f"warning: {rec.out}: {rec.recorded_nothing}")
        elif st.steps_written:
            _say(f"{rec.out}: recorded {st.steps_written} step{'s' if st.steps_written != 1 else ''} "
                 f"({st.calls_seen} calls seen, {st.model_steps} model steps) from {rec.bindings_summary()}")


def _owner(module, qualname: str) -> tuple[object, str] | None:
    """``(class, method name)`` for ``Class.method`` in ``module`` (None where absent)."""
    owner_name, _, attr = qualname.rpartition(".")
    owner = module
    try:
        for part in owner_name.split(".") if owner_name else ():
            owner = getattr(owner, part)
        getattr(owner, attr)
    except AttributeError:
        return None
    return owner, attr


def _resolve_hook(spec: str) -> tuple[object, str]:
    """``(owner, attribute)`` of a step hook named by ``ROUTETOOL_CAPTURE_STEP_HOOK`` (imported now).

    Raises:
        RouteToolError: it cannot be imported or found.
    """
    module_name, _, qualname = spec.partition(":")
    try:
        found = _owner(importlib.import_module(module_name), qualname)
    except Exception as exc:
        raise RouteToolError(f"{PREFIX}STEP_HOOK={spec!r} cannot be found ({type(exc).__name__}: {exc})",
                             fix="name the engine's per-step method as module:Class.method, or none") from None
    if found is None:
        raise RouteToolError(f"{PREFIX}STEP_HOOK={spec!r} cannot be found (no {qualname} in {module_name})",
                             fix="name the engine's per-step method as module:Class.method, or none")
    return found


class _StepHooks:
    """Wraps per-step methods: a real step resumes the recorder (the first time), runs, then
    ends the step and drains. ``dummy_run=True`` calls (V2's profile and warm-up runs) never
    resume it. A step method called inside another (a subclass calling its base) is one step.
    A failure of the recorder here never reaches the engine: one line, and the hooks stop
    recording (the step itself runs as without them)."""

    def __init__(self, recorder):
        self.recorder = recorder
        self._local = threading.local()
        self._installed: list[tuple[object, str, Callable, Callable]] = []
        self.failed = False

    def _call(self, method: Callable[[], None]) -> None:
        if self.failed:
            return
        try:
            method()
        except Exception as exc:  # never break the engine's step for a recording
            self.failed = True
            try:
                self.recorder.pause()
            except Exception:
                pass
            _say(f"recording failed at a model step ({type(exc).__name__}: {exc}); recording is off in this "
                 f"process (pid {os.getpid()}) (report this as a routetool bug)")

    def install(self, owner: object, attr: str) -> None:
        original = getattr(owner, attr)
        if getattr(original, "__routetool_step_hook__", None) is self:
            return
        try:
            dummy_at = list(inspect.signature(original).parameters).index("dummy_run")
        except (TypeError, ValueError):
            dummy_at = None
        recorder, local, call = self.recorder, self._local, self._call

        @functools.wraps(original)
        def step_hook(*args, **kwargs):
            if getattr(local, "depth", 0):
                return original(*args, **kwargs)
            dummy = kwargs.get("dummy_run", args[dummy_at] if dummy_at is not None and len(args) > dummy_at
                               else False)
            if not dummy:
                call(recorder.resume)
            local.depth = 1
            try:
                return original(*args, **kwargs)
            finally:
                local.depth = 0
                call(recorder.step)

        step_hook.__routetool_step_hook__ = self
        setattr(owner, attr, step_hook)
        self._installed.append((owner, attr, original, step_hook))

    def uninstall(self) -> None:
        for owner, attr, original, hook in reversed(self._installed):
            if getattr(owner, attr, None) is hook:
                setattr(owner, attr, original)
        self._installed.clear()
