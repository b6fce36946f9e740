"""The node's Go module (e2e/node) must select exactly the module versions the control plane's (e2e/controlplane)
selects for every module both use, and repeat its replace directives. Otherwise the packages both binaries link
are compiled twice on a cold machine (Go's build cache is keyed by their inputs), and the kubelet would run code
of another version than the API server it talks to. Reads the go.mod files only (no Go toolchain needed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def requirements(go_mod: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(require, replace) of a go.mod: module path -> version (replace: old path -> new 'path version')."""
    text = go_mod.read_text()
    require: dict[str, str] = {}
    replace: dict[str, str] = {}
    for kind, block in re.findall(r"^(require|replace) \(\n(.*?)^\)", text, re.M | re.S):
        for line in block.splitlines():
            line = line.split("//")[0].strip()
            if not line:
                continue
            if kind == "require":
                path, version = line.split()
                require[path] = version
            else:
                old, new = (part.strip() for part in line.split("=>"))
                replace[old] = new
    for path, version in re.findall(r"^require (\S+) (\S+)", text, re.M):
        require[path] = version
    return require, replace


def test_node_module_pins_the_control_planes_versions() -> None:
    cp_require, cp_replace = requirements(ROOT / "e2e/controlplane/go.mod")
    node_require, node_replace = requirements(ROOT / "e2e/node/go.mod")
    assert node_require["k8s.io/kubernetes"] == cp_require["k8s.io/kubernetes"]
    differ = {p: (cp_require[p], node_require[p]) for p in cp_require.keys() & node_require.keys() if cp_require[p] != node_require[p]}
    assert differ == {}, f"modules at other versions in e2e/node/go.mod than in e2e/controlplane/go.mod: {differ}"
    assert node_replace == cp_replace


def test_go_directives_match() -> None:
    cp = (ROOT / "e2e/controlplane/go.mod").read_text()
    node = (ROOT / "e2e/node/go.mod").read_text()
    for directive in (r"^go (\S+)$", r"^godebug (.+)$"):
        assert re.findall(directive, cp, re.M) == re.findall(directive, node, re.M), directive
