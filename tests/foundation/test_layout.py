"""House rules of the layout: the stdlib stays reachable, and the operator/runtime boundary holds."""
import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(folder: pathlib.Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_operator_folder_is_not_a_package_and_stdlib_operator_resolves():
    assert not (ROOT / "operator" / "__init__.py").exists()
    import operator

    assert operator.eq(1, 1)
    assert "site-packages" not in (operator.__file__ or "") and "kvtier" not in (operator.__file__ or "")


def test_runtime_never_imports_kopf_or_kubernetes():
    offenders = {f: n & {"kopf", "kubernetes"} for f, n in _imports(ROOT / "runtime").items()}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_operator_never_imports_torch_or_vllm():
    offenders = {f: n & {"torch", "vllm"} for f, n in _imports(ROOT / "operator").items()}
    assert {f: n for f, n in offenders.items() if n} == {}


def test_operator_uses_only_the_runtime_config_contract():
    crossing = set()
    for path in (ROOT / "operator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtier_runtime"):
                crossing.add((str(path.relative_to(ROOT)), node.module))
            if isinstance(node, ast.Import):
                crossing.update((str(path.relative_to(ROOT)), a.name) for a in node.names
                                if a.name.startswith("kvtier_runtime"))
    # the config contract, and the subcommands the `kvtier` CLI loads only when they run (replay, accuracy)
    allowed_modules = {"kvtier_runtime.config", "kvtier_runtime.replay.cli", "kvtier_runtime.accuracy.cli"}
    assert {c for c in crossing if c[1] not in allowed_modules} == set()


def test_importing_the_operator_does_not_load_torch():
    code = (
        "import sys, kvtier_operator.cli, kvtier_operator.api.validation, kvtier_operator.render, "
        "kvtier_runtime.config; print('torch' in sys.modules)"
    )
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'runtime'}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
