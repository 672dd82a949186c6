"""The `thinkspec` package's modules import each other without cycles, lazy imports included.

Every `import` / `from ... import` in a file counts, wherever it stands (module level, inside a
function, under `if TYPE_CHECKING:`): a cycle through a function-level import is still a cycle
in the design, only deferred to run time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "thinkspec"

Graph = dict[str, set[str]]  # module name -> the package modules it imports


def module_names(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _with_packages(name: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b", "a.b.c"]: importing a.b.c runs a's and a.b's __init__ first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _imported_names(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> Iterable[str]:
    """Every package module that an import statement anywhere in tree names."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _with_packages(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            yield from _with_packages(base)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # `from pkg import submodule`
                    yield f"{base}.{alias.name}"


def import_graph(package_dir: Path = PACKAGE_DIR) -> Graph:
    """module -> the package modules its imports run. A module's own ancestor packages are left
    out: they are initialised before the module's body runs, so importing them runs nothing."""
    files = module_names(package_dir)
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        ancestors = set(_with_packages(module))
        names = _imported_names(tree, module, path.name == "__init__.py", known)
        graph[module] = {n for n in names if n in known and n not in ancestors}
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle [m0, m1, ..., m0] per strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c), c[0]) for c in sorted(components)]


def _cycle_in(graph: Graph, component: set[str], start: str) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component (BFS)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    next_frontier.append(w)
        frontier = next_frontier
    raise AssertionError(f"{start} is in no cycle")


def test_graph_sees_lazy_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from . import other\n")
    (pkg / "sub" / "other.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub.leaf\n"
    )
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.leaf"}  # the package __init__ runs first
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.sub.other"}  # its own package is already running
    assert find_cycles(graph) == []
    (pkg / "sub" / "other.py").write_text("def g():\n    from ..a import f\n")
    assert find_cycles(import_graph(pkg)) == [
        ["pkg.a", "pkg.b", "pkg.sub.leaf", "pkg.sub.other", "pkg.a"]
    ]


def test_thinkspec_has_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
