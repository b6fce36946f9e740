"""A real Kubernetes control plane for tests: kube-apiserver (etcd embedded), kube-controller-manager, kubectl.

The binaries are built from the k8s.io/kubernetes Go modules by `e2e/controlplane/run` and cached outside the
tree. One server starts per test session (`bare_controlplane`); `controlplane` is that server with every
manifest in `crds/` applied and Established. It stops at the end of the session even after failures; if
pytest dies without tearing down, the server notices that its owner (this pytest process) is gone and stops.

`KVTIER_CONTROLPLANE_KUBECONFIG=<path>` reuses an already running server instead (fast local iteration: start
one with `e2e/controlplane/run start DIR` and point at DIR/kubeconfig); it is then neither started nor stopped.

Tests that use these fixtures are marked `controlplane`.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN = REPO_ROOT / "e2e" / "controlplane" / "run"
CRDS_DIR = REPO_ROOT / "crds"
KUBECONFIG_ENV = "KVTIER_CONTROLPLANE_KUBECONFIG"
FIELD_MANAGER = "kvtier-tests"
ESTABLISH_TIMEOUT_S = 60.0
# A cold build is far longer than this; CI runs `e2e/controlplane/run build` before pytest (see docs).
START_TIMEOUT_S = 300.0


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or prepared."""


@dataclass
class ControlPlane:
    """A running API server as tests see it: its admin kubeconfig and ways to talk to it."""

    kubeconfig: Path
    bin_dir: Path | None = None
    state_dir: Path | None = None  # None when reusing a server this session did not start
    _dynamic: DynamicClient | None = field(default=None, repr=False)

    def api_client(self, impersonate: str | None = None, groups: Sequence[str] = ()) -> client.ApiClient:
        """A fresh ApiClient as the admin or, with `impersonate`, as that user (e.g.
        "system:serviceaccount:NS:NAME", whose service-account groups the server adds by itself).
        Close it (it is a context manager) when done."""
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        if impersonate:
            api.set_default_header("Impersonate-User", impersonate)
        elif groups:
            raise ValueError("impersonating groups needs a user to impersonate")
        if groups:
            _add_header_lines(api, "Impersonate-Group", groups)
        return api

    def dynamic(self, impersonate: str | None = None) -> DynamicClient:
        """A DynamicClient; the admin one is shared by the session (discovery is the slow part)."""
        if impersonate:
            return DynamicClient(self.api_client(impersonate))
        if self._dynamic is None:
            self._dynamic = DynamicClient(self.api_client())
        return self._dynamic

    def apply(
        self,
        manifest: dict[str, Any],
        field_manager: str = FIELD_MANAGER,
        force: bool = False,
        dynamic: DynamicClient | None = None,
    ) -> dict[str, Any]:
        """Server-side apply one object as `field_manager`; returns the object the server stored."""
        dyn = dynamic or self.dynamic()
        resource = dyn.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        stored = dyn.server_side_apply(
            resource,
            body=manifest,
            namespace=manifest.get("metadata", {}).get("namespace"),
            field_manager=field_manager,
            force_conflicts=force,
        )
        return stored.to_dict()

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this server and return its completed process (text output)."""
        return subprocess.run(
            [str(self._kubectl_path()), "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )

    def _kubectl_path(self) -> Path:
        if self.bin_dir is None:
            self.bin_dir = build()
        return self.bin_dir / "kubectl"


def _add_header_lines(api: client.ApiClient, name: str, values: Sequence[str]) -> None:
    """Send one `name` header line per value on every request of `api`.

    The client keeps headers in a dict (one value per name), but the API server reads each Impersonate-Group
    line as one group, so the lines are added where the client hands its headers to urllib3."""
    pool = api.rest_client.pool_manager
    send = pool.request

    def request(method: str, url: str, headers: Any = None, **kwargs: Any) -> Any:
        lines = urllib3.HTTPHeaderDict(headers or {})
        for value in values:
            lines.add(name, value)
        return send(method, url, headers=lines, **kwargs)

    pool.request = request  # type: ignore[method-assign]


def build() -> Path:
    """Build the control-plane binaries if the cache lacks them; return their directory.

    The build's progress goes to stderr (pytest shows it with a failure): a cold build takes longer than a
    test's timeout, so CI runs `e2e/controlplane/run build` before pytest."""
    proc = subprocess.run([str(RUN), "build"], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ControlPlaneError("e2e/controlplane/run build failed (its output is above)")
    return Path(proc.stdout.strip().splitlines()[-1])


def start(state_dir: Path, owner_pid: int) -> Path:
    """Start a control plane with its state in `state_dir`; it stops by itself once `owner_pid` exits."""
    env = {**os.environ, "KVTIER_CONTROLPLANE_OWNER_PID": str(owner_pid)}
    proc = subprocess.run(
        [str(RUN), "start", str(state_dir)], capture_output=True, text=True, env=env, timeout=START_TIMEOUT_S
    )
    if proc.returncode != 0:
        raise ControlPlaneError(f"e2e/controlplane/run start failed:\n{proc.stderr[-4000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def stop(state_dir: Path) -> None:
    proc = subprocess.run([str(RUN), "stop", str(state_dir)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise ControlPlaneError(f"e2e/controlplane/run stop failed:\n{proc.stderr[-4000:]}")


def manifest_documents(directory: Path) -> list[dict[str, Any]]:
    """Every object in the *.yaml / *.yml files of `directory`, in file-name order; [] if it is missing/empty."""
    if not directory.is_dir():
        return []
    documents: list[dict[str, Any]] = []
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
        for index, document in enumerate(yaml.safe_load_all(path.read_text())):
            if document is None:
                continue
            if not isinstance(document, dict) or "apiVersion" not in document or "kind" not in document:
                raise ControlPlaneError(f"{path} document {index}: not a Kubernetes object (apiVersion/kind)")
            documents.append(document)
    return documents


def is_established(crd: dict[str, Any]) -> bool:
    """Whether a CustomResourceDefinition (as a dict) reports condition Established=True."""
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def wait_established(cp: ControlPlane, names: Sequence[str], timeout_s: float = ESTABLISH_TIMEOUT_S) -> None:
    """Wait until every named CRD is Established, so the first test can create its objects."""
    with cp.api_client() as api:
        ext = client.ApiextensionsV1Api(api)
        deadline = time.monotonic() + timeout_s
        for name in names:
            while True:
                crd = api.sanitize_for_serialization(ext.read_custom_resource_definition(name))
                if is_established(crd):
                    break
                if time.monotonic() > deadline:
                    conditions = (crd.get("status") or {}).get("conditions")
                    raise ControlPlaneError(f"CRD {name} not Established after {timeout_s}s: {conditions}")
                time.sleep(0.2)


def apply_manifests(cp: ControlPlane, documents: Sequence[dict[str, Any]], source: str = "a test") -> None:
    """Apply `documents` (forcing: the test run owns these objects) and wait for their CRDs to be Established."""
    crds = []
    for document in documents:
        try:
            cp.apply(document, force=True)
        except (ApiException, DynamicApiError) as exc:
            what = f"{document['kind']} {document.get('metadata', {}).get('name')}"
            raise ControlPlaneError(f"the API server refused {what} (from {source}): HTTP {exc.status}: {exc.body}") from exc
        if document["kind"] == "CustomResourceDefinition":
            crds.append(document["metadata"]["name"])
    wait_established(cp, crds)
    if crds:
        # The shared dynamic client discovered resources before these CRDs existed.
        cp.dynamic().resources.invalidate_cache()


@pytest.fixture(scope="session")
def bare_controlplane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The session's API server before crds/ is applied. Tests of the server itself use it, so that a CRD the
    server refuses fails the tests that need that CRD, not every test."""
    reuse = os.environ.get(KUBECONFIG_ENV)
    if reuse:
        kubeconfig = Path(reuse)
        if not kubeconfig.is_file():
            raise ControlPlaneError(f"{KUBECONFIG_ENV}={reuse}: no such file")
        yield ControlPlane(kubeconfig=kubeconfig)  # kubectl: ours, built on first use (not whatever is on PATH)
        return
    bin_dir = build()
    state_dir = tmp_path_factory.mktemp("controlplane")
    kubeconfig = start(state_dir, owner_pid=os.getpid())
    try:
        yield ControlPlane(kubeconfig=kubeconfig, bin_dir=bin_dir, state_dir=state_dir)
    finally:
        stop(state_dir)


@pytest.fixture(scope="session")
def controlplane(bare_controlplane: ControlPlane) -> ControlPlane:
    """The session's API server with every manifest in crds/ applied and every CRD Established."""
    apply_manifests(bare_controlplane, manifest_documents(CRDS_DIR), source="crds/")
    return bare_controlplane


def namespace_name_hint(node_name: str) -> str:
    """A label value naming the test that owns a namespace (labels allow 63 chars of [A-Za-z0-9._-])."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", node_name).strip("-._")[:63].rstrip("-._") or "test"


@pytest.fixture
def namespace(bare_controlplane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (the namespace controller empties it)."""
    with bare_controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        created = core.create_namespace(
            client.V1Namespace(
                metadata=client.V1ObjectMeta(
                    generate_name="kvtier-test-",
                    labels={"kvtier.io/test": namespace_name_hint(request.node.name)},
                )
            )
        )
        name = created.metadata.name
        try:
            yield name
        finally:
            try:
                core.delete_namespace(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
