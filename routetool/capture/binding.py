"""Find and replace every binding of a function, in the modules loaded now and in those loaded later.

An engine binds its routing function in more than one module. vLLM 0.33 defines
``fused_musespark1x_routing`` in ``vllm/models/muse_spark/common/ops/fused_routing.py``, and both
of its call sites (``common/moe.py``, ``nvidia/model.py``) bind it with
``from vllm.models.muse_spark.common.ops.fused_routing import fused_musespark1x_routing``. A
from-import copies the reference when it runs; and importing the defining module runs the
package ``__init__``, which imports ``nvidia/model.py`` and ``common/moe.py`` first. Replacing the
defining module's attribute afterwards therefore reaches no caller. :class:`Bindings` does not
depend on that order:

* at start, every attribute of every loaded module (``sys.modules``) that *is* the original
  function (identity, never the name: an alias ``from m import f as g`` is found too) gets the
  wrapper. Nothing is imported to look (a target whose module is not loaded yet is waited for,
  unless the caller asks to import it);
* afterwards, :class:`ImportWatcher` (one finder first on ``sys.meta_path``) sees every module
  that finishes executing: a target's defining module gets the wrapper as soon as its body
  has run (so the from-imports that follow bind the wrapper), and any other module's
  attributes that hold the original are replaced (those that hold the wrapper are noted, so
  that they are restored too);
* :meth:`Bindings.restore` puts the original back everywhere the wrapper is bound at module
  level (also where a from-import bound it during the recording) and removes the watcher.

What it cannot reach: a reference held elsewhere than in a module's namespace (an instance or
class attribute, a closure, a ``functools.partial``) taken before the start. Engines keep the
routing function at module level (both MuseSpark1x call sites do).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable

from routetool_kernels.spec import RouterSpec
from routetool.errors import RouteToolError

SEED_PARAMETERS = ("gating_output", "bias", *RouterSpec.KERNEL_KEYWORDS, "topk_weights", "topk_ids")
"""Positional parameters of the seed's signature (``is_padding`` is keyword-only)."""

_TARGET_FIX = "e.g. vllm.models.muse_spark.common.ops.fused_routing:fused_musespark1x_routing"


def split_target(spec: str) -> tuple[str, str]:
    """``module:function`` -> ``(module, function)``.

    Raises:
        RouteToolError: not of that form.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or "." in attr or ":" in attr:
        raise RouteToolError(f"target {spec!r} is not module:function", fix=_TARGET_FIX)
    return module_name, attr


def import_target(spec: str) -> types.ModuleType:
    """The module of ``module:function``, imported if it is not loaded yet (or still loading).

    Raises:
        RouteToolError: a malformed spec, a module that cannot be imported, no such attribute.
    """
    module_name, attr = split_target(spec)
    module = sys.modules.get(module_name)
    if not isinstance(module, types.ModuleType) or _initializing(module):
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RouteToolError(f"cannot import module {module_name!r} ({exc})",
                                 fix="record in the Python environment of the engine, or name the module that "
                                     "holds the routing function") from None
    if not hasattr(module, attr):
        raise RouteToolError(f"module {module_name!r} has no attribute {attr!r}",
                             fix="name the routing function as module:function")
    return module


def check_routing_function(spec: str, fn: object) -> None:
    """Check that ``fn`` (found at ``spec``) has the seed's signature.

    Raises:
        RouteToolError: not callable, no readable signature, or other leading parameters than
            ``(gating_output, bias, topk, route_scale, ...)``.
    """
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


def module_namespace(module: object) -> dict | None:
    """A module's ``__dict__`` without running its code (None for anything else, or a module
    whose namespace cannot be read)."""
    if not isinstance(module, types.ModuleType):
        return None
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except Exception:
        return None
    return namespace if isinstance(namespace, dict) else None


def names_bound_to(module: object, values: Iterable[object]) -> list[tuple[str, object]]:
    """``(attribute, value)`` of ``module``'s namespace whose value *is* one of ``values``."""
    namespace = module_namespace(module)
    if namespace is None:
        return []
    wanted = {id(v) for v in values}
    try:
        items = list(namespace.items())
    except Exception:  # a namespace changed by another thread while copied
        return []
    return [(name, value) for name, value in items if id(value) in wanted and isinstance(name, str)]


def loaded_modules() -> list[tuple[str, types.ModuleType]]:
    """A snapshot of ``sys.modules`` (modules only)."""
    while True:
        try:
            items = list(sys.modules.items())
            break
        except RuntimeError:  # changed size while copied (an import on another thread)
            continue
    return [(name, m) for name, m in items if isinstance(m, types.ModuleType)]


# -- the import watcher -----------------------------------------------------------------------------
class _NotifyingLoader:
    """Delegates to a module's own loader and reports the module once its body has run. The
    module's ``__loader__`` and ``__spec__.loader`` get the real loader back after executing,
    so nothing sees this wrapper after the import."""

    def __init__(self, loader, watcher: ImportWatcher):
        self._loader = loader
        self._watcher = watcher

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            try:  # into the namespace: a module may refuse setattr once its body ran (torch's config modules)
                namespace = module_namespace(module)
                spec = namespace.get("__spec__") if namespace is not None else None
                if getattr(spec, "loader", None) is self:
                    spec.loader = self._loader
                if namespace is not None and namespace.get("__loader__") is self:
                    namespace["__loader__"] = self._loader
            except Exception:
                pass
        self._watcher.loaded(module)


class ImportWatcher:
    """A ``sys.meta_path`` finder that finds nothing itself: it asks the finders after it, and
    wraps the loader of the spec they return, so that every listener hears of each module
    that finishes executing (see the module docstring). One instance, :data:`WATCHER`, is
    installed while it has listeners."""

    def __init__(self):
        self._lock = threading.RLock()
        self._listeners: list[Callable[[types.ModuleType], None]] = []

    def find_spec(self, fullname, path, target=None):
        meta_path = list(sys.meta_path)
        try:
            after = meta_path[meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in after:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is None:
                continue
            loader = spec.loader
            if loader is not None and hasattr(loader, "exec_module") and not isinstance(loader, _NotifyingLoader):
                spec.loader = _NotifyingLoader(loader, self)
            return spec
        return None

    def invalidate_caches(self):
        pass

    def add(self, listener: Callable[[types.ModuleType], None]) -> None:
        """Call ``listener(module)`` for each module that finishes executing from now on."""
        with self._lock:
            self._listeners.append(listener)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def remove(self, listener: Callable[[types.ModuleType], None]) -> None:
        """Stop calling ``listener``; the finder leaves ``sys.meta_path`` with its last listener."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
            if not self._listeners:
                while self in sys.meta_path:
                    sys.meta_path.remove(self)

    def loaded(self, module: types.ModuleType) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(module)
            except Exception as exc:  # never break the import of the engine's module
                warnings.warn(f"routetool: after importing {getattr(module, '__name__', module)}: "
                              f"{type(exc).__name__}: {exc}", stacklevel=2)


WATCHER = ImportWatcher()


def when_imported(module_name: str, callback: Callable[[types.ModuleType], None]) -> Callable[[], None]:
    """Call ``callback(module)`` once: now if ``module_name`` is loaded, else when it finishes
    executing. Returns a function that cancels the wait (nothing is imported here)."""
    done = threading.Event()

    def listener(module: types.ModuleType) -> None:
        if getattr(module, "__name__", None) == module_name and not done.is_set():
            done.set()
            WATCHER.remove(listener)
            callback(module)

    def cancel() -> None:
        done.set()
        WATCHER.remove(listener)

    WATCHER.add(listener)
    module = sys.modules.get(module_name)
    if isinstance(module, types.ModuleType) and not _initializing(module):
        listener(module)
    return cancel


def _initializing(module: types.ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


# -- the bindings of one or more targets ---------------------------------------------------------
class Bindings:
    """Every module-level binding of the target functions, replaced by their wrappers (see the
    module docstring).

    Args:
        specs: ``module:function`` targets (the defining module, or any module that holds the
            function: a from-import's module works too).
        make_wrapper: ``fn -> wrapper``, called once per distinct original function.
        on_error: called with the error of a target that turns out bad when its module is
            imported later (no exception may cross an import of the engine).

    Attributes:
        sites: ``module.attribute`` of every binding replaced or found bound to a wrapper, in
            the order found.
        waiting: targets whose module was not loaded yet (to be bound when it is).
    """

    def __init__(self, specs: Iterable[str], make_wrapper: Callable[[Callable], Callable],
                 on_error: Callable[[RouteToolError], None]):
        self.specs = tuple(specs)
        self._targets = [split_target(s) for s in self.specs]
        self._make_wrapper = make_wrapper
        self._on_error = on_error
        self._lock = threading.RLock()
        self._wrappers: dict[int, tuple[Callable, Callable]] = {}  # id(original) -> (original, wrapper)
        self._bound: dict[tuple[int, str], tuple[types.ModuleType, str, Callable, Callable]] = {}
        self.sites: list[str] = []
        self.waiting: list[str] = list(self.specs)
        self._started = False
        self._stopped = False

    # -- start --------------------------------------------------------------------------------------
    def start(self, import_modules: bool) -> None:
        """Bind the wrappers now and from now on.

        Args:
            import_modules: import a target's module that is not loaded yet (errors raised
                here); False: wait for the engine to import it.

        Raises:
            RouteToolError: a malformed target; with ``import_modules``, a module that cannot
                be imported or lacks the function; a function without the seed's signature.
        """
        self._started = True
        WATCHER.add(self._loaded)
        try:
            for spec, (module_name, attr) in zip(self.specs, self._targets):
                module = sys.modules.get(module_name)
                if import_modules:
                    module = import_target(spec)
                if isinstance(module, types.ModuleType):
                    self._resolve(spec, module, attr, raise_errors=True)
            self._scan_all()
        except BaseException:
            self.restore()
            raise

    def _resolve(self, spec: str, module: types.ModuleType, attr: str, raise_errors: bool) -> bool:
        """Take the original from ``module.attr`` (a target's module): check it, make its wrapper,
        bind it there. False while the attribute does not exist yet."""
        with self._lock:
            if spec not in self.waiting:
                return False
            namespace = module_namespace(module)
            if namespace is None or attr not in namespace:
                return False
            value = namespace[attr]
            original = next((fn for fn, wrapper in self._wrappers.values() if wrapper is value), value)
            self.waiting.remove(spec)
            try:
                check_routing_function(spec, original)
            except RouteToolError as exc:
                if raise_errors:
                    raise
                self._on_error(exc)
                return False
            if id(original) not in self._wrappers:
                self._wrappers[id(original)] = (original, self._make_wrapper(original))
            self._bind_module(module)
            return True

    def _bind_module(self, module: types.ModuleType, replace: bool = True) -> None:
        """Replace ``module``'s bindings of an original (``replace``); note its bindings of a wrapper."""
        wrappers = {id(w): (fn, w) for fn, w in self._wrappers.values()}
        values = [fn for fn, _ in self._wrappers.values()] + [w for _, w in self._wrappers.values()]
        for name, value in names_bound_to(module, values):
            key = (id(module), name)
            if key in self._bound:
                continue
            if id(value) in wrappers:
                fn, wrapper = wrappers[id(value)]
            elif not replace:
                continue
            else:
                fn, wrapper = self._wrappers[id(value)]
                try:
                    setattr(module, name, wrapper)
                except Exception:  # a module that refuses assignment keeps the original
                    continue
            self._bound[key] = (module, name, fn, wrapper)
            self.sites.append(f"{getattr(module, '__name__', '?')}.{name}")

    def _scan_all(self) -> None:
        with self._lock:
            if not self._wrappers:
                return
            for _, module in loaded_modules():
                self._bind_module(module)

    def _loaded(self, module: types.ModuleType) -> None:
        """A module finished executing: bind a waiting target, then its module's bindings."""
        with self._lock:
            if self._stopped:
                return
            resolved = False
            for spec, (module_name, attr) in zip(self.specs, self._targets):
                if spec in self.waiting:
                    defining = sys.modules.get(module_name)
                    if isinstance(defining, types.ModuleType):
                        resolved |= self._resolve(spec, defining, attr, raise_errors=False)
            if resolved:
                self._scan_all()  # modules loaded before the target's module (e.g. bound later by hand)
            elif self._wrappers:
                self._bind_module(module)

    # -- stop -----------------------------------------------------------------------------------------
    def restore(self) -> list[str]:
        """Put the originals back wherever a wrapper is bound at module level; stop watching.
        Returns the bindings left alone because someone else replaced them meanwhile."""
        WATCHER.remove(self._loaded)
        with self._lock:
            self._stopped = True
            if not self._wrappers:
                return []
            for _, module in loaded_modules():
                self._bind_module(module, replace=False)  # wrappers bound since the last look
            left = []
            for module, name, fn, wrapper in reversed(list(self._bound.values())):
                namespace = module_namespace(module)
                current = namespace.get(name) if namespace is not None else None
                if current is wrapper:
                    try:
                        setattr(module, name, fn)
                    except Exception:
                        left.append(f"{getattr(module, '__name__', '?')}.{name}")
                elif current is not fn:
                    left.append(f"{getattr(module, '__name__', '?')}.{name}")
            self._bound.clear()
            return left
