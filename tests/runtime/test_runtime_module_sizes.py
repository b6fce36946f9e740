"""Packages kept in parts, checked on the source with ``ast``: the remote tier (``kvtier_runtime.remote``) has no
module over 400 lines and no function over 60 -- a module named for one concern (connection and health, the
capacity index, batched I/O, values, presence), each function readable in one screen."""
from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[2] / "runtime" / "kvtier_runtime"
# package (under kvtier_runtime) -> (most lines in a module, most lines in a function or method)
LIMITS = {"remote": (400, 60)}


def size_violations(package: Path, max_lines: int, max_function: int) -> list[str]:
    """Modules of ``package`` longer than ``max_lines`` and functions longer than ``max_function`` lines."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > max_lines:
            bad.append(f"{path.name}: {lines} lines (at most {max_lines})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > max_function:
                    bad.append(f"{path.name}:{node.lineno}: {node.name} is {length} lines (at most {max_function})")
    return bad


def test_the_remote_tier_stays_in_parts() -> None:
    for package, (max_lines, max_function) in LIMITS.items():
        assert size_violations(RUNTIME / package, max_lines, max_function) == []


def test_the_size_check_catches_a_long_module_and_a_long_function(tmp_path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(8))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    pass\n" + "# filler\n" * 4)
    assert size_violations(tmp_path, 20, 9) == []
    assert size_violations(tmp_path, 14, 8) == [
        "long.py: 17 lines (at most 14)", "long.py:1: f is 9 lines (at most 8)"]
