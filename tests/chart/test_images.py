"""The images, checked without a container engine: pinned bases, copied files that exist, a non-root user, the
package's own commands as entrypoints, and no torch in the operator image."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from chart.dockerfile import parse
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
DOCKERFILES = sorted(IMAGES.glob("*.Dockerfile"))
# A tag that names one release (v0.33.0, 3.11.14-slim-bookworm), or a digest.
PINNED = re.compile(r"^[^:@\s]+(:v?[0-9]+\.[0-9]+\.[0-9]+[A-Za-z0-9._-]*)?(@sha256:[a-f0-9]{64})?$")


def _pinned(ref: str) -> bool:
    return bool(PINNED.match(ref)) and (":" in ref or "@sha256:" in ref)


def test_both_images_exist():
    assert {p.name for p in DOCKERFILES} == {"operator.Dockerfile", "runtime.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_base_image_is_pinned(path):
    dockerfile = parse(path)
    stage_names = {s.name for s in dockerfile.stages if s.name}
    for stage in dockerfile.stages:
        if stage.base in stage_names:
            continue
        assert _pinned(stage.base), f"{path.name}: FROM {stage.base} is not pinned to a release tag or digest"


def test_pin_check_rejects_floating_tags():
    assert not _pinned("python:3.11-slim") and not _pinned("vllm/vllm-openai:latest") and not _pinned("python")
    assert _pinned("python:3.11.14-slim-bookworm") and _pinned("vllm/vllm-openai:v0.33.0")
    assert _pinned("python@sha256:" + "0" * 64)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_exist_in_the_build_context(path):
    dockerfile = parse(path)
    copies = [i for s in dockerfile.stages for i in s.all("COPY") + s.all("ADD")]
    assert copies
    for copy in copies:
        words = copy.value.split()
        if any(w.startswith("--from=") for w in words):
            continue
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{path.name}:{copy.line}: COPY {source} does not exist"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_a_non_root_user(path):
    users = parse(path).final.all("USER")
    assert users, f"{path.name}: the final stage sets no USER (it would run as root)"
    user = users[-1].value.split(":")[0]
    assert user.isdigit() and int(user) != 0, f"{path.name}: USER {user} (use a numeric non-root uid)"


def test_operator_entrypoint_is_the_packages_command_and_matches_the_chart():
    dockerfile = parse(IMAGES / "operator.Dockerfile")
    entrypoint = dockerfile.exec_form("ENTRYPOINT")
    assert entrypoint == ["kvtier"] and SCRIPTS["kvtier"] == "kvtier_operator.cli:main"
    from kvtier_operator import cli

    assert dockerfile.exec_form("CMD") == ["operator"]
    assert "operator" in {name for name, _, _ in cli._EXTERNAL}
    deployment = (ROOT / "charts" / "kvtier" / "templates" / "deployment.yaml").read_text()
    assert 'command: ["kvtier", "operator"]' in deployment
    # The chart runs as the uid the image declares.
    values = (ROOT / "charts" / "kvtier" / "values.yaml").read_text()
    assert "runAsUser: 65532" in values and dockerfile.final.all("USER")[-1].value == "65532:65532"


def test_runtime_image_installs_kvtier_into_vllm_and_keeps_vllms_command():
    dockerfile = parse(IMAGES / "runtime.Dockerfile")
    assert dockerfile.final.base == "vllm/vllm-openai:v0.33.0"
    runs = " ".join(i.value for i in dockerfile.final.all("RUN"))
    # --no-deps: kvtier's pins must not replace vLLM's torch.
    assert "pip install" in runs and "--no-deps" in runs and "kvtier-" in runs
    assert "import kvtier_runtime.config" in runs
    assert dockerfile.exec_form("ENTRYPOINT") == ["vllm", "serve"]


def _closure(requirements: list[str]) -> set[str]:
    """Names of the installed distributions these requirements pull in (markers evaluated for this Python)."""
    seen: set[str] = set()
    queue = [Requirement(r) for r in requirements]
    while queue:
        req = queue.pop()
        name = req.name.lower().replace("_", "-")
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            if sub_req.marker and not any(sub_req.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                continue
            queue.append(sub_req)
    return seen


def test_operator_image_installs_no_torch():
    dockerfile = parse(IMAGES / "operator.Dockerfile")
    runs = " ".join(i.value for s in dockerfile.stages for i in s.all("RUN"))
    assert '".[operator]"' in runs and "runtime]" not in runs and "all]" not in runs
    project = PYPROJECT["project"]
    closure = _closure(project["dependencies"] + project["optional-dependencies"]["operator"])
    assert {"kopf", "kubernetes", "pydantic"} <= closure
    heavy = {n for n in closure if n in {"torch", "vllm", "triton"} or n.startswith("nvidia-")}
    assert heavy == set()


def test_closure_check_would_see_torch():
    assert "torch" in _closure(PYPROJECT["project"]["optional-dependencies"]["runtime"])
