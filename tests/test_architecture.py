"""The import graph of routetool/ and kernel/ (imported as routetool_kernels) has no cycle.

Every import counts, also one inside a function (a cycle hidden in a function-level import is
still a cycle: the two modules cannot be understood, tested or moved apart). ``from X import
name`` is an edge to ``X.name`` when that is a module, and to ``X`` (its ``__init__`` runs)
always; relative imports are resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"routetool": ROOT / "routetool", "routetool_kernels": ROOT / "kernel"}
"""Top-level package name -> its folder."""


def modules(packages: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages``."""
    out = {}
    for top, folder in packages.items():
        for f in sorted(folder.rglob("*.py")):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([top, *parts])] = f
    return out


def _imported(name: str, f: Path) -> set[str]:
    """The dotted names ``f`` (module ``name``) imports anywhere in its body."""
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            out.add(source)
            out.update(f"{source}.{a.name}" for a in node.names)
    return out


def import_graph(packages: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (each name cut to its longest module prefix)."""
    mods = modules(packages)
    graph = {}
    for name, f in mods.items():
        deps = set()
        for dotted in _imported(name, f):
            while dotted and dotted not in mods:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name:
                deps.add(dotted)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_in_routetool_or_its_kernels():
    graph = import_graph(PACKAGES)
    assert "routetool.io.inputs" in graph and "routetool_kernels.spec" in graph  # (the packages were read)
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (function-level imports counted): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_check_finds_a_cycle_closed_by_a_function_level_or_relative_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import os\nfrom pkg.b import helper\n",
        "b.py": "def helper():\n    from pkg import a\n    return a\n",
        "c.py": "from pkg.b import helper\n",  # (imports into the cycle, is no part of it)
        "sub/__init__.py": "",
        "sub/d.py": "from . import e\n",
        "sub/e.py": "def g():\n    from .d import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph({"pkg": pkg})
    assert graph["pkg.c"] == {"pkg.b"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.sub.d", "pkg.sub.e"]]
    (pkg / "b.py").write_text("def helper():\n    return 1\n")
    (pkg / "sub/e.py").write_text("x = 1\n")
    assert import_cycles(import_graph({"pkg": pkg})) == []
