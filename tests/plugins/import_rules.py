"""Import rules checked on a package's source with ``ast`` (nothing is imported), shared by the runtime's and the
operator's tests: every module's imports, relative ones resolved, and the rules both packages keep -- no module
imports another module's underscore name, nor anything from a private module; two parts kept apart import nothing
of each other."""
from __future__ import annotations

import ast
from pathlib import Path

# Private names of other projects that the vLLM plug-ins need and vLLM offers no public name for.
THIRD_PARTY_PRIVATE = frozenset({
    ("vllm", "_custom_ops"),  # vLLM's cache ops (swap_blocks), only reachable there
    ("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa"),  # the CPU attention backend's page layout
})


def modules_of(root: Path) -> list[tuple[str, Path, ast.Module]]:
    """(dotted module name, path, tree) of every module under ``root`` (a package directory: ``kvtier_runtime``)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path, ast.parse(path.read_text(), str(path))))
    return out


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, tree: ast.Module) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None for ``import x``) of every import, relative ones resolved."""
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, target, alias.name) for alias in node.names]
    return out


def private_import_violations(root: Path) -> list[str]:
    """``from x import _name``, ``from x._mod import name`` or ``import x._mod``, where x is another module."""
    bad = []
    for module, path, tree in modules_of(root):
        for line, target, name in imports_of(module, path, tree):
            # The imported name and every part of the module it comes from (``redis._parsers.base``).
            parts = target.split(".") + (name.split(".") if name else [])
            private = [p for p in parts if p.startswith("_") and not p.startswith("__")]
            if not private or target == module or (target, name) in THIRD_PARTY_PRIVATE:
                continue
            bad.append(f"{path.relative_to(root.parent)}:{line}: {module} imports {name or target} from {target}")
    return bad


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def apart_violations(root: Path, first: str, second: str) -> list[str]:
    """Imports of ``second`` (a module or package of ``root``, e.g. ``slo``) in ``first``, and the reverse."""
    a, b = f"{root.name}.{first}", f"{root.name}.{second}"
    bad = []
    for module, path, tree in modules_of(root):
        for line, target, name in imports_of(module, path, tree):
            full = f"{target}.{name}" if name else target  # `from kvtier_runtime import fs` imports the package
            for here, there in ((a, b), (b, a)):
                if _under(module, here) and (_under(target, there) or _under(full, there)):
                    bad.append(f"{path.relative_to(root.parent)}:{line}: {module} imports {full}")
    return bad
