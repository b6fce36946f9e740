"""Import rules of the runtime package, checked on its source with ``ast`` (nothing is imported):

* the filesystem tier (``kvtier_runtime.fs``) and the remote tier (``kvtier_runtime.remote``) never import each
  other: what they share lives in ``kvtier_runtime.tiers``, so either can change without breaking the other;
* no module imports another module's underscore name, nor anything from a private module (``redis._parsers``):
  what crosses a module boundary is public (the only exceptions are the third-party private names the vLLM
  plug-ins cannot do without, listed in ``plugins.import_rules``);
* the engine plug-ins (``engines/``) never sort tiers by medium: no comparison by medium, no per-medium tier list,
  no cast, no ``list[Any]`` (each tier is a slot of the books, asked what it is through the Tier protocol);
* the books (``store/books.py``) never decide by a tier's kind: no isinstance/issubclass against a tier class, no
  ``is_remote``-style test or attribute, no comparison of a tier's ``medium``/``origin``, and no per-kind tier
  list (``fs_tiers``/``remote_tiers``): the books take one ordered list and each question is asked of the tier
  (``kvtier_runtime.tiers.base.Tier``).

Each rule's checker takes the package root, so the same checks can be pointed at an older tree."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from plugins.import_rules import apart_violations, private_import_violations

RUNTIME = Path(__file__).resolve().parents[2] / "runtime" / "kvtier_runtime"

# What a kind test in the books looks like, besides isinstance against a *Tier class.
KIND_MARKERS = frozenset({"remote", "is_remote", "_is_remote", "is_fs", "_is_fs", "medium", "origin", "kind"})
TIER_LISTS = frozenset({"fs_tiers", "remote_tiers"})


def fs_remote_violations(root: Path) -> list[str]:
    """Imports from kvtier_runtime.remote in kvtier_runtime.fs, and the reverse."""
    return apart_violations(root, "fs", "remote")


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def kind_branch_violations(root: Path) -> list[str]:
    """Places where store/books.py tells one kind of tier from another instead of asking the tier."""
    path = root / "store" / "books.py"
    tree = ast.parse(path.read_text(), str(path))
    bad = []

    def flag(node: ast.AST, why: str) -> None:
        bad.append(f"store/books.py:{getattr(node, 'lineno', 0)}: {why}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in {"isinstance", "issubclass"} and len(node.args) == 2:
                classes = _names(node.args[1])
                if any(c.endswith("Tier") for c in classes):
                    flag(node, f"{node.func.id} against {sorted(c for c in classes if c.endswith('Tier'))}")
            if node.func.id in {"getattr", "hasattr"} and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and arg.value in KIND_MARKERS:
                    flag(node, f"{node.func.id}(..., {arg.value!r})")
        if isinstance(node, (ast.FunctionDef, ast.Name, ast.Attribute)):
            name = node.name if isinstance(node, ast.FunctionDef) else (
                node.id if isinstance(node, ast.Name) else node.attr)
            if name.lstrip("_").startswith(("is_remote", "is_fs", "is_filesystem")):
                flag(node, f"kind test {name}")
            if isinstance(node, ast.Attribute) and name == "remote":
                flag(node, "a tier's 'remote' attribute")
        if isinstance(node, ast.Compare):
            names = _names(node)
            # Equality with a medium or an origin is a kind test; membership in a table (validation) is not.
            equality = any(isinstance(op, (ast.Eq, ast.NotEq, ast.Is, ast.IsNot)) for op in node.ops)
            if equality and names & {"medium", "origin"}:
                flag(node, f"comparison of a tier's {sorted(names & {'medium', 'origin'})}")
            if names & TIER_LISTS:
                flag(node, f"comparison with {sorted(names & TIER_LISTS)} (a tier's kind by its position)")
        if isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Attribute) and inner.attr in TIER_LISTS:
                    flag(inner, f"{node.name} picks tiers by constructor list ({inner.attr})")
                if isinstance(inner, ast.arg) and inner.arg in TIER_LISTS:
                    flag(inner, f"{node.name} takes a per-kind tier list ({inner.arg})")
    return bad


MEDIA = frozenset({"filesystem", "remote", "disk"})


def engine_kind_violations(root: Path) -> list[str]:
    """Places in the engine plug-ins (``engines/``) that sort tiers by medium instead of asking the tier: a
    comparison with a medium's name or of a ``medium``/``origin``, a per-medium tier list, a ``cast`` (to a tier
    class, or anything: the engine's types come from the Tier protocol), a ``list[Any]``."""
    bad = []
    for path in sorted((root / "engines").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                consts = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                if consts & MEDIA or _names(node) & {"medium", "origin"}:
                    bad.append(f"{where}:{node.lineno}: a comparison by medium")
            if isinstance(node, ast.Attribute) and node.attr in TIER_LISTS:
                bad.append(f"{where}:{node.lineno}: a per-medium tier list ({node.attr})")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "cast":
                bad.append(f"{where}:{node.lineno}: a cast")
            if isinstance(node, ast.AnnAssign) and "tier" in ast.unparse(node.target).lower() \
                    and ast.unparse(node.annotation) == "list[Any]":
                bad.append(f"{where}:{node.lineno}: a list[Any] of tiers")
    return bad


@pytest.mark.parametrize("check", [fs_remote_violations, private_import_violations, kind_branch_violations,
                                   engine_kind_violations],
                         ids=["fs-and-remote-never-import-each-other", "no-private-name-crosses-a-module",
                              "books-never-branch-on-a-tier-kind", "the-engine-never-sorts-tiers-by-medium"])
def test_runtime_import_rules_hold(check) -> None:
    assert check(RUNTIME) == []


def test_the_checks_catch_what_they_forbid(tmp_path) -> None:
    """Each checker flags a planted violation of its rule, so a clean run above is not a checker that sees
    nothing (the package's own files are checked above; these are minimal copies of the forbidden shapes)."""
    pkg = tmp_path / "kvtier_runtime"
    for sub in ("fs", "remote", "store"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "fs" / "jobs.py").write_text("class _Job: ...\n")
    (pkg / "remote" / "tier.py").write_text("from ..fs.jobs import _Job\nimport kvtier_runtime.fs\n"
                                            "from redis._parsers.base import BaseParser\n")
    (pkg / "fs" / "tier.py").write_text("from kvtier_runtime import remote\nfrom vllm import _custom_ops\n")
    (pkg / "store" / "books.py").write_text(
        "from ..fs.tier import FilesystemTier\n"
        "class OffloadBooks:\n"
        "    def __init__(self, fs_tiers, remote_tiers):\n"
        "        self.fs_tiers = list(fs_tiers)\n"
        "    def _is_remote(self, i):\n"
        "        return i >= len(self.fs_tiers)\n"
        "    def finish(self, tier):\n"
        "        if isinstance(tier, FilesystemTier) or tier.remote or tier.medium == 'remote':\n"
        "            return getattr(tier, 'remote', False)\n")
    assert len(fs_remote_violations(pkg)) == 3
    assert [v.split(": ", 1)[1] for v in private_import_violations(pkg)] == [
        "kvtier_runtime.remote.tier imports _Job from kvtier_runtime.fs.jobs",
        "kvtier_runtime.remote.tier imports BaseParser from redis._parsers.base"]
    (pkg / "engines").mkdir()
    (pkg / "engines" / "offloading.py").write_text(
        "from typing import Any, cast\n"
        "def plan(tiers, plans):\n"
        "    fs_tiers: list[Any] = [t for t, p in zip(tiers, plans) if p.medium == 'filesystem']\n"
        "    first = cast('FilesystemTier', fs_tiers[0])\n"
        "    return first, plans.remote_tiers\n")
    assert sorted(v.split(": ", 1)[1] for v in engine_kind_violations(pkg)) == [
        "a cast", "a comparison by medium", "a list[Any] of tiers", "a per-medium tier list (remote_tiers)"]
    found = "\n".join(kind_branch_violations(pkg))
    for why in ("kind test _is_remote", "isinstance against ['FilesystemTier']", "a tier's 'remote' attribute",
                "comparison of a tier's ['medium']", "getattr(..., 'remote')", "picks tiers by constructor list",
                "(a tier's kind by its position)", "__init__ takes a per-kind tier list (remote_tiers)"):
        assert why in found
