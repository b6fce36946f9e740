"""The kind provider (e2e/scenario/kind), checked as far as a machine without a container engine can: its
manifests against the real API server (server-side dry run, the CRD's own validation included), the policy
against the local provider's, the engine's arguments against the engine, the Prometheus config with promtool,
the chart values with helm, and the script's syntax and the files it uses. The cluster itself is not created here.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kvtier_operator.api.validation import validate_text
from kvtier_operator.workload import has_config_args
from scenario import manifests

REPO = Path(__file__).resolve().parents[2]
KIND = REPO / "e2e" / "scenario" / "kind"
MANIFESTS = sorted((KIND / "manifests").glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[dict]:
    return [d for p in MANIFESTS for d in documents(p)]


def find(kind: str, name: str) -> dict:
    return next(d for d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_the_policy_is_the_local_providers_with_the_in_cluster_prometheus():
    text = (KIND / "manifests" / "policy.yaml").read_text()
    assert validate_text(text, "policy.yaml") == []
    kind_policy = yaml.safe_load(text)
    local = manifests.policy(manifests.Names(), "http://prometheus.monitoring.svc:9090")
    assert kind_policy == local


def test_the_workload_names_the_config_once_and_the_engine_accepts_its_arguments(tmp_path):
    dep = find("Deployment", "llama-demo")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert has_config_args(container, ["--config", "/etc/kvtier/engine.yaml"])
    assert dep["spec"]["selector"]["matchLabels"] == find("KVCachePolicy", "llama-demo")["spec"]["selector"][
        "matchLabels"]
    # The same arguments, on loopback and a free port, with a rendered config where the mount would put it.
    config = tmp_path / "engine.yaml"
    config.write_text("block-size: 16\n")
    args = [a for a in container["args"] if not a.startswith(("--host=", "--port="))]
    args = [str(config) if a == "/etc/kvtier/engine.yaml" else a for a in args]
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, str(REPO / "e2e" / "synthetic_engine" / "engine.py"), *args,
                             "--host=127.0.0.1", "--port=0", "--port-file", str(port_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert port_file.exists(), proc.communicate(timeout=5)[0] if proc.poll() is not None else "no port"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_prometheus_config_passes_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install -y --no-install-recommends prometheus")
    config = find("ConfigMap", "prometheus")["data"]["prometheus.yml"]
    parsed = yaml.safe_load(config)
    scrape = parsed["scrape_configs"][0]
    assert scrape["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["kvtier-demo"]}}]
    # Debian builds Prometheus without Kubernetes service discovery, so its promtool rejects that one block;
    # everything else (relabelling, intervals) is checked with a file_sd block in its place.
    checked = yaml.safe_load(config)
    checked["scrape_configs"][0].pop("kubernetes_sd_configs")
    checked["scrape_configs"][0]["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(checked))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    targets = {r.get("target_label") for r in scrape["relabel_configs"]}
    assert {"namespace", "pod"} <= targets  # what the SLO guard's queries select on


@pytest.mark.controlplane
def test_every_manifest_is_accepted_by_the_api_server(controlplane):
    """Namespaces for real, everything else as a server-side dry run (schemas, RBAC, the CRD's CEL rules)."""
    from kvtier_operator.kube import APPLY, ApiError, Kube

    kube = Kube(str(controlplane.kubeconfig))
    docs = all_documents()
    namespaces = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    created = []
    try:
        for name in namespaces:
            if kube.get(f"/api/v1/namespaces/{name}") is None:
                kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
                created.append(name)
        dyn = controlplane.dynamic()
        refused = []
        for d in docs:
            if d["kind"] == "Namespace":
                continue
            resource = dyn.resources.get(api_version=d["apiVersion"], kind=d["kind"])
            path = resource.path(name=d["metadata"]["name"], namespace=d["metadata"].get("namespace"))
            try:
                kube.request("PATCH", path, query=[("fieldManager", "kind-e2e"), ("dryRun", "All")], body=d,
                             content_type=APPLY)
            except ApiError as err:
                refused.append(f"{d['kind']}/{d['metadata']['name']}: {err}")
        assert refused == []
    finally:
        for name in created:
            kube.delete(f"/api/v1/namespaces/{name}")
        kube.close()


def test_the_chart_renders_with_the_kind_values(helm):
    values = yaml.safe_load((KIND / "values.yaml").read_text())
    rendered = helm.template(values)
    [dep] = [d for d in rendered if d["kind"] == "Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "kvtier-operator:e2e" and container["imagePullPolicy"] == "Never"
    assert "--namespace=kvtier-demo" in container["args"]
    assert dep["metadata"]["name"] == "kvtier"  # run.sh reads deploy/kvtier's log on failure


def test_the_script_parses_and_uses_only_files_that_exist():
    script = (KIND / "run.sh").read_text()
    subprocess.run(["bash", "-n", str(KIND / "run.sh")], check=True)
    used = set(re.findall(r'"\$here/([^"]+)"', script)) | set(re.findall(r'"\$repo/([^"]+)"', script))
    assert used, "run.sh names its files relative to $here and $repo"
    missing = [p for p in used if not ((KIND / p) if (KIND / p).exists() else (REPO / p)).exists()]
    assert missing == []
    dockerfile = (KIND / "engine.Dockerfile").read_text()
    assert re.search(r"^FROM python:\d+\.\d+\.\d+-slim-\w+$", dockerfile, re.M)  # pinned base
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (REPO / "e2e" / "synthetic_engine" / source).is_file()  # the build context run.sh passes
    kind_config = yaml.safe_load((KIND / "kind-config.yaml").read_text())
    assert all("@sha256:" in n["image"] for n in kind_config["nodes"])
