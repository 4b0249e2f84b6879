"""The vLLM plugin: record the routing call site in every engine and worker process.

vLLM calls each function of the entry-point group ``vllm.general_plugins`` in every process it
starts (API server, engine core, each GPU worker), before the model is built. routetool's entry
point (``routetool_capture`` in pyproject.toml) is :func:`register`. It does nothing unless
``ROUTETOOL_CAPTURE_DIR`` names a run folder; then, in each process, it starts a
:class:`~routetool.capture.recorder.RoutingRecorder` that writes ``<DIR>/rank-<r>/trace.json``
(+ shards), ``r`` being the process's global rank, with its DP/TP/EP/PP ranks and the world
size in the metadata (:mod:`routetool.capture.ranks`, from vLLM's parallel state). Processes
that never route (the API server, the engine core) write nothing.

The recorder patches the routing function when the plugin loads, so calls made while vLLM
warms up, profiles memory and captures CUDA graphs reach the record op (and graphs are captured
with it), but it stays paused until the first model step: it resumes on the first call of the
step hook (default ``GPUModelRunner.execute_model``), and after each model step it ends the
step and drains the ring. Options, all by environment (vLLM gives plugins no other channel;
an unknown ``ROUTETOOL_CAPTURE_*`` name is an error, so a typo cannot pass silently):

======================================  ======================================================
variable                                meaning (default)
======================================  ======================================================
``ROUTETOOL_CAPTURE_DIR``               the run folder (created if its parent exists); unset:
                                        the plugin does nothing
``ROUTETOOL_CAPTURE_TARGET``            ``module:function`` to record (the seed's
                                        ``fused_musespark1x_routing``)
``ROUTETOOL_CAPTURE_TARGETS``           more ``module:function`` places, comma-separated
``ROUTETOOL_CAPTURE_LAYERS``            MoE layers per step: ``58`` (layers 0-57), ``3-60``
                                        (layers 3 to 60), or ``3,5,7``; required
``ROUTETOOL_CAPTURE_EVERY``             record one step in N (1)
``ROUTETOOL_CAPTURE_SKIP``              steps to skip first (0)
``ROUTETOOL_CAPTURE_MAX_TOKENS``        stop before the step that would take the token rows
                                        per layer over this budget (none)
``ROUTETOOL_CAPTURE_OUTPUTS``           ``1``: also record topk_ids/topk_weights; ``0``: inputs
                                        only (1)
``ROUTETOOL_CAPTURE_RING_MB``           device ring per process, MiB (256)
``ROUTETOOL_CAPTURE_RING_STEPS``        step slots of the ring (256)
``ROUTETOOL_CAPTURE_SHARD_MB``          write a shard per this many MB (256)
``ROUTETOOL_CAPTURE_STEP_HOOK``         ``module:Class.method`` run once per model step, or
                                        ``none`` (record from the first call, drain only when
                                        a call runs Python)
                                        (``vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model``)
``ROUTETOOL_CAPTURE_MODEL``             the traces' model name
``ROUTETOOL_CAPTURE_FORCE``             ``1``: replace an earlier recording in the folder (0)
======================================  ======================================================
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from routetool.errors import RouteToolError
from routetool.numtext import parse_float, parse_int

PREFIX = "ROUTETOOL_CAPTURE_"
DIR = PREFIX + "DIR"
DEFAULT_STEP_HOOK = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model"
OPTIONS = ("DIR", "TARGET", "TARGETS", "LAYERS", "EVERY", "SKIP", "MAX_TOKENS", "OUTPUTS", "RING_MB", "RING_STEPS",
           "SHARD_MB", "STEP_HOOK", "MODEL", "FORCE")


@dataclass(frozen=True)
class PluginConfig:
    """The plugin's options, read from the environment by :func:`config_from_env`."""

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
    step_hook: str | None = DEFAULT_STEP_HOOK
    step_hook_given: bool = False
    model: str = ""
    force: bool = False


def _int(env: Mapping[str, str], name: str, default: int | None, minimum: int) -> int | None:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    value = parse_int(text)
    if value is None or value < minimum:
        raise RouteToolError(f"{PREFIX}{name}={text!r} is not an integer >= {minimum}",
                             fix=f"e.g. {PREFIX}{name}={max(minimum, 1)}")
    return value


def _mb(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    value = parse_float(text)
    if value is None or not value > 0 or value == float("inf"):
        raise RouteToolError(f"{PREFIX}{name}={text!r} is not a size in MiB > 0", fix=f"e.g. {PREFIX}{name}=256")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(PREFIX + name)
    if text is None or text == "":
        return default
    if text not in ("0", "1"):
        raise RouteToolError(f"{PREFIX}{name}={text!r} is neither 0 nor 1", fix=f"{PREFIX}{name}=1 or 0")
    return text == "1"


def parse_layers(text: str) -> tuple[int, ...]:
    """``58`` -> layers 0..57; ``3-60`` -> 3..60; ``3,5,7`` -> those (distinct, >= 0).

    Raises:
        RouteToolError: anything else.
    """
    fix = f"{PREFIX}LAYERS=58 (layers 0-57), =3-60 (layers 3 to 60) or =3,5,7"
    lo, dash, hi = text.partition("-")
    if dash:
        a, b = parse_int(lo), parse_int(hi)
        if a is None or b is None or a < 0 or b < a:
            raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a range of layers FIRST-LAST", fix=fix)
        return tuple(range(a, b + 1))
    if "," in text:
        ids = [parse_int(part) for part in text.split(",")]
        if any(i is None or i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a list of distinct layer indexes", fix=fix)
        return tuple(ids)
    count = parse_int(text)
    if count is None or count < 1:
        raise RouteToolError(f"{PREFIX}LAYERS={text!r} is not a layer count, range or list", fix=fix)
    return tuple(range(count))


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
        step_hook=None if hook == "none" else (hook or DEFAULT_STEP_HOOK),
        step_hook_given=bool(hook),
        model=env.get(PREFIX + "MODEL", ""),
        force=_flag(env, "FORCE", False),
    )


_RECORDER = None
"""The recorder this process's :func:`register` started (one per process)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: start recording in this process if
    ``ROUTETOOL_CAPTURE_DIR`` is set (see the module docstring). Called again in the same
    process, it does nothing.

    Raises:
        RouteToolError: bad options, a run folder whose parent is missing, a target that
            cannot be imported, or a step hook given explicitly that cannot be found.
    """
    global _RECORDER
    if _RECORDER is not None:
        return
    config = config_from_env()
    if config is None:
        return
    from routetool.capture.recorder import DEFAULT_TARGET, RoutingRecorder

    try:
        config.run_dir.mkdir(exist_ok=True)
    except OSError as exc:
        raise RouteToolError(f"cannot make the run folder ({exc.strerror or exc})", path=config.run_dir,
                             fix=f"set {DIR} to a folder whose parent exists and is writable") from None
    hook = _resolve_hook(config)
    recorder = RoutingRecorder(
        config.run_dir / "rank-{rank}" / "trace.json", target=config.target or DEFAULT_TARGET,
        targets=config.targets, num_layers=len(config.layer_ids), layer_ids=config.layer_ids,
        every_n_steps=config.every_n_steps, skip_steps=config.skip_steps, max_tokens=config.max_tokens,
        record_outputs=config.record_outputs, ring_mb=config.ring_mb, ring_steps=config.ring_steps,
        shard_mb=config.shard_mb, model=config.model, force=config.force,
        provenance=f"recorded by routetool's vLLM plugin (pid {os.getpid()}); options: "
                   + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(PREFIX)),
        paused=hook is not None, require_calls=False,
    )
    recorder.start()
    if hook is not None:
        _install_hook(recorder, *hook)
    _RECORDER = recorder
    print(f"routetool: recording {recorder.target} into {config.run_dir}/rank-<rank>/ (pid {os.getpid()})",
          file=sys.stderr)


def _resolve_hook(config: PluginConfig) -> tuple[object, str] | None:
    """``(owner, attribute)`` of the step hook, or None. The default hook is optional (it is
    absent in processes and vLLM versions without the V1 GPU model runner)."""
    if config.step_hook is None:
        return None
    module_name, _, qualname = config.step_hook.partition(":")
    owner_name, _, attr = qualname.rpartition(".")
    try:
        owner = importlib.import_module(module_name)
        for part in owner_name.split(".") if owner_name else ():
            owner = getattr(owner, part)
        getattr(owner, attr)
    except Exception as exc:
        if not config.step_hook_given:
            return None
        raise RouteToolError(f"{PREFIX}STEP_HOOK={config.step_hook!r} cannot be found ({type(exc).__name__}: {exc})",
                             fix="name the engine's per-step method as module:Class.method, or none") from None
    return owner, attr


def _install_hook(recorder, owner: object, attr: str) -> None:
    """Wrap ``owner.attr`` so that each model step resumes the recorder (the first time), runs,
    then ends the step and drains the ring."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def step_hook(*args, **kwargs):
        recorder.resume()
        try:
            return original(*args, **kwargs)
        finally:
            recorder.step()

    setattr(owner, attr, step_hook)
