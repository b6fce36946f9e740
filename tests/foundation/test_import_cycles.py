"""No import cycle among the operator's and the runtime's own modules, checked on their source with ``ast``.

Every import counts, including one inside a function: a function-level import that only dodges a cycle still
ties the two modules together (neither can be understood, tested or moved without the other), so the shared
piece belongs in a module both import. Function-level imports of third-party modules (torch, redis, vLLM: heavy
or optional dependencies) are not edges of this graph, since only the two packages' own modules are nodes.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package, else to ``pkg``.
Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``, but those are not edges: a package's
``__init__`` importing its own submodules would otherwise make every package a cycle."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = (REPO / "operator" / "kvtier_operator", REPO / "runtime" / "kvtier_runtime")

# Cycles accepted for now, each as the sorted modules of its strongly connected component, with the reason.
ACCEPTED: dict[tuple[str, ...], str] = {}


def modules(roots: tuple[Path, ...]) -> dict[str, tuple[Path, ast.Module]]:
    """Dotted name -> (path, tree) of every module under each package root."""
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = (path, ast.parse(path.read_text(), str(path)))
    return out


def import_graph(mods: dict[str, tuple[Path, ast.Module]]) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same packages: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, (path, tree) in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in mods else source
                           for alias in node.names]
            for target in targets:
                # `import a.b.c` names a.b.c; a dotted name that is not a module is an attribute of the longest
                # module it starts with.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def describe(component: list[str], graph: dict[str, dict[str, int]],
             mods: dict[str, tuple[Path, ast.Module]]) -> str:
    inside = set(component)
    lines = [f"  {mods[a][0].relative_to(REPO)}:{line}: {a} imports {b}"
             for a in component for b, line in sorted(graph[a].items()) if b in inside]
    return "cycle among " + ", ".join(component) + "\n" + "\n".join(lines)


def test_no_import_cycle_among_the_packages_modules() -> None:
    mods = modules(PACKAGES)
    assert len(mods) > 50  # both packages were found
    graph = import_graph(mods)
    found = [c for c in cycles(graph) if tuple(c) not in ACCEPTED]
    assert not found, "\n".join(describe(c, graph, mods) for c in found)


def test_the_check_sees_a_cycle_hidden_in_a_function(tmp_path) -> None:
    """A planted cycle whose back edge is a function-level relative import is found, with both edges named;
    a function-level import of a third-party module and a package importing its own submodule are not edges."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import helper\n")
    (pkg / "sub" / "b.py").write_text("def helper():\n    import torch\n    from . import a\n    return a, torch\n")
    (pkg / "c.py").write_text("import pkg.sub.a\nfrom pkg.sub.b import helper\n")
    mods = modules((pkg,))
    graph = import_graph(mods)
    assert graph["pkg.sub.b"] == {"pkg.sub.a": 3}
    assert graph["pkg.c"] == {"pkg.sub.a": 1, "pkg.sub.b": 2}
    assert cycles(graph) == [["pkg.sub.a", "pkg.sub.b"]]
