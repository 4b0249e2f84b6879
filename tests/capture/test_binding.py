"""Finding every binding of the recorded function (routetool.capture.binding), whatever the import order."""

import sys
import textwrap
import types

import pytest
import torch

from routetool.capture.binding import WATCHER, Bindings
from routetool.capture.recorder import RoutingRecorder
from routetool.errors import RouteToolError
from routetool.io.trace import open_trace

E, K = 12, 3
SIGNATURE = ("gating_output, bias, topk, route_scale, router_output_multiplier=None, "
             "router_score_normalization='sigmoid', router_score_division_eps=None, topk_weights=None, "
             "topk_ids=None, *, is_padding=None")


@pytest.fixture
def package(tmp_path, monkeypatch):
    """Write a package ``name`` whose ``__init__`` imports a caller that from-imports the routing
    function of ``name.ops`` under another name (as vLLM 0.33's muse_spark package does), before
    ``name.ops`` can be patched; forget it afterwards."""
    made = []

    def make(name: str, signature: str = SIGNATURE) -> str:
        root = tmp_path / name
        root.mkdir()
        (root / "__init__.py").write_text("from . import caller\n")
        (root / "ops.py").write_text(textwrap.dedent(f"""
            from routetool_kernels.reference import musespark1x_routing_reference


            def route({signature}):
                return musespark1x_routing_reference(gating_output, bias, topk, route_scale, is_padding=is_padding)
        """))
        (root / "caller.py").write_text(f"from {name}.ops import route as fused\n\n\ndef forward(x, bias):\n"
                                        f"    return fused(x, bias, {K}, 1.0)\n")
        made.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in [n for n in sys.modules if any(n == m or n.startswith(m + ".") for m in made)]:
        del sys.modules[name]


@pytest.mark.parametrize("import_targets", [True, False], ids=["imported-at-start", "imported-by-the-engine"])
def test_a_caller_that_from_imported_the_function_first_is_recorded(package, tmp_path, import_targets):
    name = package("routetool_test_pkg_a")
    rec = RoutingRecorder(tmp_path / "run.json", target=f"{name}.ops:route", num_layers=1,
                          import_targets=import_targets).start()
    assert (name in sys.modules) == import_targets  # nothing imported just to look
    import importlib

    caller = importlib.import_module(f"{name}.caller")
    x = torch.randn(5, E)
    for _ in range(3):
        caller.forward(x, torch.zeros(E))
    rec.close()
    assert rec.stats.calls_recorded == 3
    assert set(rec.stats.bindings) == {f"{name}.ops.route", f"{name}.caller.fused"}
    ops = sys.modules[f"{name}.ops"]
    assert caller.fused is ops.route and not hasattr(ops.route, "__routetool_recorder__")  # restored
    assert WATCHER not in sys.meta_path
    with open_trace(tmp_path / "run.json") as t:
        assert [s.num_tokens for s in t.steps(0)] == [5, 5, 5]


def test_modules_imported_after_stop_are_left_alone(package, tmp_path):
    name = package("routetool_test_pkg_b")
    rec = RoutingRecorder(tmp_path / "run.json", target=f"{name}.ops:route", num_layers=1, import_targets=False,
                          require_calls=False).start()
    rec.close()
    import importlib

    caller = importlib.import_module(f"{name}.caller")
    assert not hasattr(caller.fused, "__routetool_recorder__") and rec.stats.bindings == []


def test_a_bad_target_found_at_import_stops_recording_not_the_import(package, tmp_path):
    name = package("routetool_test_pkg_c", signature="x, bias, topk, route_scale, is_padding=None")
    rec = RoutingRecorder(tmp_path / "run.json", target=f"{name}.ops:route", num_layers=1,
                          import_targets=False).start()
    import importlib

    caller = importlib.import_module(f"{name}.caller")  # imports fine
    assert not hasattr(caller.fused, "__routetool_recorder__")
    with pytest.raises(RouteToolError, match="not the seed's"):
        rec.close()


class _NoDict(types.ModuleType):
    @property
    def __dict__(self):
        raise RuntimeError("no namespace here")


class _Frozen(types.ModuleType):
    def __setattr__(self, name, value):
        raise AttributeError(f"{name} is read-only")


def test_odd_modules_are_tolerated(monkeypatch):
    """Entries of sys.modules that are no modules, a module whose __dict__ raises, and one that
    refuses assignment: looked at without error; the one that refuses keeps the original."""
    def route(gating_output, bias, topk, route_scale):
        return gating_output

    defining = types.ModuleType("routetool_test_defining")
    defining.route = route
    frozen = _Frozen("routetool_test_frozen")
    frozen.__dict__["route"] = route
    for mod in (defining, frozen, _NoDict("routetool_test_nodict")):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, "routetool_test_none", None)
    monkeypatch.setitem(sys.modules, "routetool_test_object", object())
    wrappers = []

    def make_wrapper(fn):
        wrappers.append(lambda *a, **k: fn(*a, **k))
        return wrappers[-1]

    b = Bindings(["routetool_test_defining:route"], make_wrapper, on_error=pytest.fail)
    b.start(import_modules=False)
    try:
        assert defining.route is wrappers[0] and frozen.route is route
        assert "routetool_test_defining.route" in b.sites and "routetool_test_frozen.route" not in b.sites
    finally:
        assert b.restore() == []
    assert defining.route is route and WATCHER not in sys.meta_path


def test_an_alias_made_during_the_recording_is_restored(monkeypatch):
    def route(gating_output, bias, topk, route_scale):
        return gating_output

    defining = types.ModuleType("routetool_test_defining2")
    defining.route = route
    monkeypatch.setitem(sys.modules, defining.__name__, defining)
    b = Bindings([f"{defining.__name__}:route"], lambda fn: (lambda *a, **k: fn(*a, **k)), on_error=pytest.fail)
    b.start(import_modules=False)
    late = types.ModuleType("routetool_test_late")
    late.fused = defining.route  # `from defining import route as fused`, while recording
    monkeypatch.setitem(sys.modules, late.__name__, late)
    b.restore()
    assert late.fused is route and defining.route is route


def test_a_target_not_importable_at_start_is_bound_once_it_is(tmp_path, monkeypatch):
    """The plugin may load before the engine's packages are importable (a path added later)."""
    site = tmp_path / "later"
    site.mkdir()
    (site / "routetool_test_pkg_d").mkdir()
    (site / "routetool_test_pkg_d" / "__init__.py").write_text(
        f"def route({SIGNATURE}):\n    return gating_output\n")
    rec = RoutingRecorder(tmp_path / "run.json", target="routetool_test_pkg_d:route", num_layers=1,
                          import_targets=False, require_calls=False).start()
    try:
        monkeypatch.syspath_prepend(str(site))
        import importlib

        pkg = importlib.import_module("routetool_test_pkg_d")
        assert pkg.route.__routetool_recorder__ is rec
    finally:
        rec.close()
        sys.modules.pop("routetool_test_pkg_d", None)
    assert rec.stats.bindings == ["routetool_test_pkg_d.route"]
