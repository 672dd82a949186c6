"""The `thinkspec` package's imports point one way.

- Modules: no cycle, counting every `import` / `from ... import` wherever it stands (module level,
  inside a function, under `if TYPE_CHECKING:`): a cycle through a function-level import is still a
  cycle in the design, only deferred to run time.
- Packages (`thinkspec.engine`, `thinkspec.toy`, ...; a module directly under `thinkspec/` is its own
  node): no cycle among the imports that run, function-level ones included and those under
  `if TYPE_CHECKING:` left out (a proposer may name the engine's `Sequence` in its annotations).
- The engine core (`thinkspec.engine_args`, `thinkspec.engine`, `thinkspec.sampling`,
  `thinkspec.spec_decode`) never runs an import of `thinkspec.toy` or `thinkspec.bench`, directly or
  through another module.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
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


def _is_type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`, the test of an `if` whose body never runs."""
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _import_statements(tree: ast.AST, runtime_only: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """The import statements of tree; runtime_only leaves out the bodies of `if TYPE_CHECKING:`."""
    if isinstance(tree, (ast.Import, ast.ImportFrom)):
        yield tree
        return
    if runtime_only and isinstance(tree, ast.If) and _is_type_checking(tree.test):
        children: Iterable[ast.AST] = tree.orelse
    else:
        children = ast.iter_child_nodes(tree)
    for child in children:
        yield from _import_statements(child, runtime_only)


def _imported_names(
    tree: ast.AST, module: str, is_package: bool, known: set[str], runtime_only: bool = False
) -> Iterable[str]:
    """Every package module that an import statement in tree names (anywhere; with runtime_only,
    outside `if TYPE_CHECKING:`)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in _import_statements(tree, runtime_only):
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


def import_graph(package_dir: Path = PACKAGE_DIR, runtime_only: bool = False) -> Graph:
    """module -> the package modules its imports run (runtime_only: less those under
    `if TYPE_CHECKING:`). A module's own ancestor packages are left out: they are initialised
    before the module's body runs, so importing them runs nothing."""
    files = module_names(package_dir)
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        ancestors = set(_with_packages(module))
        names = _imported_names(tree, module, path.name == "__init__.py", known, runtime_only)
        graph[module] = {n for n in names if n in known and n not in ancestors}
    return graph


def package_of(module: str) -> str:
    """"thinkspec.engine.scheduler" -> "thinkspec.engine"; "thinkspec.llm" and "thinkspec" stay."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: Graph) -> Graph:
    """The module graph with each module merged into its package (package_of); no self-edges."""
    packages: Graph = {package_of(m): set() for m in graph}
    for module, imported in graph.items():
        packages[package_of(module)] |= {package_of(n) for n in imported} - {package_of(module)}
    return packages


def import_path(graph: Graph, start: str, is_target: Callable[[str], bool]) -> list[str] | None:
    """The shortest chain of imports start -> ... -> a module that is_target accepts, or None (BFS)."""
    parent: dict[str, str] = {start: start}
    frontier = [start]
    while frontier:
        next_frontier = []
        for v in frontier:
            if is_target(v):
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            for w in sorted(graph[v] - parent.keys()):
                parent[w] = v
                next_frontier.append(w)
        frontier = next_frontier
    return None


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


def test_package_graph_counts_the_imports_that_run(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("core", "extra"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("")
    (pkg / "core" / "a.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    from pkg.extra import b\nelse:\n    import pkg.top\n"
    )
    (pkg / "extra" / "b.py").write_text("def f():\n    from pkg.core import a\n")
    runtime = import_graph(pkg, runtime_only=True)
    assert runtime["pkg.core.a"] == {"pkg.top"}  # the else branch runs, the TYPE_CHECKING body not
    assert import_graph(pkg)["pkg.core.a"] == {"pkg.extra", "pkg.extra.b", "pkg.top"}
    packages = package_graph(runtime)
    assert packages == {"pkg": set(), "pkg.top": set(), "pkg.core": {"pkg.top"}, "pkg.extra": {"pkg.core"}}
    assert find_cycles(packages) == []
    chain = import_path(runtime, "pkg.extra.b", lambda m: m == "pkg.top")
    assert chain == ["pkg.extra.b", "pkg.core.a", "pkg.top"]
    assert import_path(runtime, "pkg.core.a", lambda m: m.startswith("pkg.extra")) is None
    (pkg / "core" / "a.py").write_text("def g():\n    import pkg.extra.b\n")  # a function-level import
    packages = package_graph(import_graph(pkg, runtime_only=True))
    assert find_cycles(packages) == [["pkg.core", "pkg.extra", "pkg.core"]]


def test_thinkspec_packages_import_one_way():
    cycles = find_cycles(package_graph(import_graph(runtime_only=True)))
    assert not cycles, "package import cycles (run time):\n" + "\n".join(" -> ".join(c) for c in cycles)


CORE = ("thinkspec.engine_args", "thinkspec.engine", "thinkspec.sampling", "thinkspec.spec_decode")
HARNESS = ("thinkspec.toy", "thinkspec.bench")


def test_the_engine_core_never_imports_the_toy_or_bench_packages():
    graph = import_graph(runtime_only=True)
    core = sorted(m for m in graph if package_of(m) in CORE)
    assert len(core) > 20 and "thinkspec.engine.engine" in core and "thinkspec.engine_args" in core
    chains = [import_path(graph, m, lambda n: package_of(n) in HARNESS) for m in core]
    found = [" -> ".join(chain) for chain in chains if chain is not None]
    assert not found, "the engine core imports the harness at run time:\n" + "\n".join(found)
