"""Where kernels run: the compiled GPU path or the Triton interpreter on the CPU.

The choice is made once, at the command-line edge, before :mod:`kernel` is imported:
Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is defined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from routetool_kernels.spec import RouterSpec
from routetool.errors import RouteToolError, first_line
from routetool.io.paths import path_kind

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class Execution:
    """The execution mode chosen for a run.

    Attributes:
        device: torch device the tensors live on.
        interpreted: kernels run under the Triton interpreter (CPU).
        device_name: GPU name, or a description of the CPU mode.
    """

    device: torch.device
    interpreted: bool
    device_name: str

    def for_kernel(self, fn) -> Execution:
        """This execution as it applies to the kernel ``fn``: on the CPU a kernel that uses no
        Triton (:func:`uses_triton`: a plain torch function) runs as it is, not under the Triton
        interpreter, and ``device_name`` says ``CPU``."""
        if self.interpreted and not uses_triton(fn):
            return dataclasses.replace(self, device_name="CPU")
        return self


def _kernels_interpreted() -> bool | None:
    """How the already imported kernels were defined (None when not imported yet)."""
    mod = sys.modules.get("routetool_kernels.routing_jit")
    if mod is None:
        return None
    return type(mod._routing_kernel).__name__ == "InterpretedFunction"


def select_execution(choice: str) -> Execution:
    """Resolve ``--device`` (auto|cuda|cpu) and prepare Triton for it.

    ``auto`` takes the GPU when torch sees one, else the CPU. ``cpu`` runs the kernels
    under the Triton interpreter.

    Raises:
        RouteToolError: ``cuda`` asked for without a usable GPU, or the kernels were
            already loaded in this process in the other mode.
    """
    import torch

    if choice not in DEVICE_CHOICES:
        raise RouteToolError(f"unknown device {choice!r}", fix="use auto, cuda or cpu")
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise RouteToolError("--device cuda: torch sees no CUDA GPU", fix="use --device cpu (Triton interpreter)")
    use_cuda = has_cuda and choice != "cpu"
    loaded = _kernels_interpreted()
    if use_cuda:
        if os.environ.get("TRITON_INTERPRET") == "1" or loaded is True:
            raise RouteToolError(
                "TRITON_INTERPRET=1 is set, so kernels would not be compiled for the GPU",
                fix="unset TRITON_INTERPRET, or pass --device cpu",
            )
        device = torch.device("cuda", torch.cuda.current_device())
        return Execution(device=device, interpreted=False, device_name=torch.cuda.get_device_name(device))
    if loaded is False:
        raise RouteToolError(
            "kernels were already compiled for the GPU in this process; the CPU needs the interpreter",
            fix="run --device cpu in a fresh process",
        )
    os.environ["TRITON_INTERPRET"] = "1"
    # numpy's overflow warnings from the interpreter's emulation of exp are noise here
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    return Execution(device=torch.device("cpu"), interpreted=True, device_name="CPU (Triton interpreter)")


RoutingFn = Callable[..., tuple["torch.Tensor", "torch.Tensor"]]

SEED_SIGNATURE = (f"fn(gating_output, bias, {', '.join(RouterSpec.KERNEL_KEYWORDS)}, topk_weights, topk_ids, *, "
                  "is_padding) -> (topk_weights, topk_ids)")
"""The signature every ``--kernel`` takes (the seed's); the call passes the logits and the bias by
position and every other argument by keyword (:func:`routetool.engine.contract.call_kernel`)."""

_CALL_KEYWORDS = (*RouterSpec.KERNEL_KEYWORDS, "topk_weights", "topk_ids", "is_padding")


def signature_problem(fn: RoutingFn) -> str | None:
    """What keeps ``fn`` from taking routetool's call (:data:`SEED_SIGNATURE`), or None.

    The call is bound against ``inspect.signature(fn)`` without running anything: a parameter
    missing (``topk_weights``...), one more that has no default, the logits or the bias not
    positional. A callable whose signature Python cannot read (a builtin) is taken on trust.
    """
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(None, None, **dict.fromkeys(_CALL_KEYWORDS))
    except TypeError as exc:
        return f"wrong signature for --kernel ({exc}); it is {getattr(fn, '__name__', 'fn')}{sig}"
    return None


def uses_triton(fn: RoutingFn) -> bool:
    """Whether ``fn`` launches Triton code, as far as its module shows: its module, or a module
    whose function or module it holds (two levels deep), holds ``triton`` or a Triton JIT function
    (the project's kernels do). A plain torch function (the reference) is False: on the CPU it
    does not run under the Triton interpreter."""
    seen: set[int] = set()

    def tritonish(obj) -> bool:
        mod = getattr(obj, "__name__", "") if isinstance(obj, type(sys)) else type(obj).__module__ or ""
        return mod == "triton" or mod.startswith("triton.")

    def module_uses(name: str | None, depth: int) -> bool:
        mod = sys.modules.get(name or "")
        if mod is None or id(mod) in seen:
            return False
        seen.add(id(mod))
        for value in list(vars(mod).values()):
            if tritonish(value):
                return True
            if depth > 0:
                inner = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
                if inner and inner != name and not inner.startswith(("torch", "builtins", "routetool")) \
                        and module_uses(inner, depth - 1):
                    return True
        return False

    target = getattr(fn, "__wrapped__", fn)
    return module_uses(getattr(target, "__module__", None), 2)


class _StandInStream:
    """A stand-in for ``sys.stdout``/``sys.stderr`` (and their ``sys.__stdout__``/``sys.__stderr__``)
    while a kernel is imported or runs: writes go to ``target``, ``close()`` is ignored (a kernel
    cannot close routetool's streams), anything else (``fileno``, ``isatty``, ``encoding``...)
    is the target's."""

    def __init__(self, target):
        self._target = target

    def write(self, text: str) -> int:
        return self._target.write(text)

    def writelines(self, lines) -> None:
        self._target.writelines(lines)

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        """Ignored: the stream is routetool's."""

    @property
    def closed(self) -> bool:
        return False

    def __getattr__(self, name: str):
        if name == "_target":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._target, name)


@contextlib.contextmanager
def kernel_stdout(document_on_stdout: bool) -> Iterator[None]:
    """A context for importing and running kernels: while it is open, ``sys.stdout``,
    ``sys.stderr``, ``sys.__stdout__`` and ``sys.__stderr__`` are stand-ins that forward writes
    and ignore ``close()``. Writes to the two stdout ones (a user kernel's ``print``, a
    ``print(file=sys.__stdout__)``) go to ``sys.stderr`` when ``document_on_stdout`` (routetool
    writes a JSON, JUnit or CSV document to stdout, which must hold that document only), else to
    the stream they stand for. On exit the four are restored, also when the kernel replaced them.
    Output written to file descriptor 1 below Python is not moved.
    """
    saved = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
    out, err, real_out, real_err = saved

    def stand_in(target):
        return None if target is None else _StandInStream(target)

    sys.stdout = stand_in(err if document_on_stdout else out)
    sys.stderr = stand_in(err)
    sys.__stdout__ = stand_in(err if document_on_stdout else real_out)
    sys.__stderr__ = stand_in(real_err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__ = saved


def kernel_source(spec: str | None) -> str | None:
    """The ``.py`` file a ``--kernel path.py:function`` names (an input of the run), else None."""
    if not spec or ":" not in spec:
        return None
    module_name = spec.rpartition(":")[0]
    return module_name if module_name.endswith(".py") or os.sep in module_name else None


@contextlib.contextmanager
def _importable(folder: str) -> Iterator[None]:
    """``folder`` first on ``sys.path`` while the context is open; afterwards that entry is
    removed again (the rest of ``sys.path``, changes an imported module made included, is kept)."""
    sys.path.insert(0, folder)
    importlib.invalidate_caches()  # files written since the folder was last looked at
    try:
        yield
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:  # the module removed it itself
            pass


def load_kernel(spec: str, *, also: Sequence[str] = ()) -> tuple[str, RoutingFn]:
    """Resolve a kernel: a variant name of :data:`routetool_kernels.VARIANTS` or ``module:function``.

    ``module`` may be an importable module name or a path to a ``.py`` file. While the module
    is imported, the file's folder (for a path) or the current directory (for a module name) is
    first on ``sys.path``, as Python has it for a script or for ``python -m``, so that the
    module can import the modules beside it; ``sys.path`` is restored afterwards. The function
    must take the seed's signature (``gating_output, bias, topk, route_scale, ...``) and
    return ``(topk_weights, topk_ids)``. Call :func:`select_execution` first. ``also``: the
    other names the caller accepts (bench's ``torch``, ``torch-compile``), listed with the
    variants when ``spec`` is none of them.

    Returns:
        ``(name, function)``.

    Raises:
        RouteToolError: unknown variant, a path that is no ``.py`` file and no importable module
            (``README.md:fn``, a folder), unimportable module, missing function.
    """
    import routetool_kernels

    if spec in routetool_kernels.VARIANT_NAMES:
        return spec, routetool_kernels.variant(spec)
    if ":" not in spec:
        raise RouteToolError(
            f"unknown kernel {spec!r}",
            fix=f"use one of {', '.join((*routetool_kernels.VARIANT_NAMES, *also))} or module:function",
        )
    module_name, _, func_name = spec.rpartition(":")
    not_python = RouteToolError("is not a .py file or an importable module", path=module_name,
                                fix="name a Python file, --kernel path/to/kernel.py:function, or a module on the "
                                    "path, --kernel package.module:function")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            kind = path_kind(path, shown=module_name)
            if kind in ("missing", "dangling link"):
                raise RouteToolError("no such file", path=module_name, fix="check the --kernel path")
            spec_obj = importlib.util.spec_from_file_location(f"routetool_user_kernel_{abs(hash(path))}", path)
            if kind != "file" or spec_obj is None:  # a folder, or no Python suffix (README.md)
                raise not_python
            module = importlib.util.module_from_spec(spec_obj)
            with _importable(os.path.dirname(path)):  # its own modules beside it, as python runs a script
                spec_obj.loader.exec_module(module)
        else:
            with _importable(os.getcwd()):  # as `python -m` and `python -c` (a console script does not)
                module = importlib.import_module(module_name)
            if getattr(module, "__file__", None) is None:  # a folder without __init__.py: a namespace package
                raise not_python
    except RouteToolError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any import failure is the user's module's
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing and os.path.exists(module_name) and (module_name + ".").startswith(missing + "."):
            raise not_python from None  # a file beside that is no module (README.md:fn), not a missing dependency
        raise RouteToolError(f"cannot import ({first_line(exc)})", path=module_name,
                             fix="check the module and its dependencies") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise RouteToolError(f"has no function {func_name!r}", path=module_name, fix="name an existing function")
    problem = signature_problem(fn)
    if problem is not None:
        raise RouteToolError(problem, path=module_name, fix=f"give it the seed's signature, {SEED_SIGNATURE}")
    return spec, fn
