"""perfx's own packages import each other in one direction: the graph of their imports has no cycle.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import`` of a first-party module,
at module level, inside functions and under ``if TYPE_CHECKING:`` alike (an import moved into a function, or
kept for annotations only, to dodge a cycle still leaves two modules that cannot be understood apart).
``from package import name`` is an edge to ``package.name`` where that is a module, else to ``package``.
Importing ``a.b`` runs ``a/__init__.py`` first, but that is not counted as an edge: a package's ``__init__``
re-exporting its submodules would otherwise make every pair of siblings a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
# Where each first-party package's top directory lives (pyproject's package roots, and the plugins' own).
PACKAGE_ROOTS = {
    "perfx_core": ROOT,
    "perfx_numpy": ROOT / "backends",
    "perfx_opencl": ROOT / "backends",
    "perfx_gui": ROOT / "gui",
    "perfx_lowmem_int4": ROOT / "plugins" / "perfx-lowmem-int4",
    "perfx_numba_cpu": ROOT / "plugins" / "perfx-numba-cpu",
}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of every first-party package."""
    found = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module>`` names, relative levels resolved against ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve(module, path, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                # `import a.b.c` where only a.b is ours as a module (c an attribute): the longest known prefix.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph.add_edge(module, target)
    return graph


def test_the_graph_is_read_from_every_package():
    """The reader finds what it should: modules of every package, and edges known to exist (so an empty or
    broken reading cannot pass the cycle test below)."""
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGE_ROOTS)
    assert graph.has_edge("perfx_opencl.plugin", "perfx_opencl.ops")  # relative, module level
    assert graph.has_edge("perfx_core.api", "perfx_core.model")
    assert graph.number_of_edges() > 150


def test_a_cycle_is_found_where_there_is_one(tmp_path, monkeypatch):
    """Modules importing each other only inside a function, or only for annotations, are reported; an import of
    a name that is not a module is an edge to its package."""
    package = tmp_path / "perfx_core"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from perfx_core import a\n    return a\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (package / "d.py").write_text("from .c import C\nfrom perfx_core import VERSION\nimport numpy\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOTS", {"perfx_core": tmp_path})
    graph = import_graph()
    assert sorted(sorted(cycle) for cycle in nx.simple_cycles(graph)) == [
        ["perfx_core.a", "perfx_core.b"],
        ["perfx_core.c", "perfx_core.d"],
    ]
    assert graph.has_edge("perfx_core.d", "perfx_core") and "numpy" not in graph


def test_no_package_imports_itself_in_a_circle():
    graph = import_graph()
    cycles = sorted(" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(graph))
    if cycles:
        pytest.fail("import cycles (make each dependency go one way):\n" + "\n".join(cycles))
