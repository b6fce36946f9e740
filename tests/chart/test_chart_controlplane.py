"""The chart installed by a real helm on the real API server (tests/plugins/controlplane.py), and its RBAC
exercised by impersonating the operator's ServiceAccount and ordinary users.

What the operator must be able to do is done for real (server-side apply to a Deployment, status patches,
finalizer updates, ConfigMaps, Events); what it must not do is refused by the server's authorizer (403).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtier"
FIELD_MANAGER = "kvtier-operator"


@dataclass
class Release:
    name: str
    namespace: str  # the operator's
    serving: str  # a namespace listed in slo.authSecrets
    other: str  # a namespace not listed anywhere
    sa: str  # system:serviceaccount:...

    @property
    def fullname(self) -> str:
        return self.name if "kvtier" in self.name else f"{self.name}-kvtier"


def _namespace(core: client.CoreV1Api, prefix: str) -> str:
    return core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(generate_name=prefix))).metadata.name


def _helm(helm, controlplane, *args: str):
    return helm.run(*args, "--kubeconfig", str(controlplane.kubeconfig))


@pytest.fixture(scope="module")
def release(helm, controlplane) -> Iterator[Release]:
    with controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        names = [_namespace(core, p) for p in ("kvtier-op-", "kvtier-serving-", "kvtier-other-")]
    rel = Release(name=f"kvt-{uuid.uuid4().hex[:6]}", namespace=names[0], serving=names[1], other=names[2],
                  sa="")
    values = {
        # The session fixture already applied crds/; the chart's copy is the same object (tested offline).
        "crds": {"enabled": False},
        "peering": {"enabled": True},
        "replicaCount": 2,
        "slo": {"authSecrets": [rel.serving]},
    }
    values_file = Path(helm.env["HELM_CACHE_HOME"]) / f"{rel.name}.json"
    values_file.write_text(json.dumps(values))
    _helm(helm, controlplane, "install", rel.name, str(CHART), "--namespace", rel.namespace,
          "--values", str(values_file))
    rel.sa = f"system:serviceaccount:{rel.namespace}:{rel.fullname}"
    try:
        yield rel
    finally:
        _helm(helm, controlplane, "uninstall", rel.name, "--namespace", rel.namespace)
        with controlplane.api_client() as api:
            core = client.CoreV1Api(api)
            for ns in names:
                core.delete_namespace(ns)


def _denied(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
    except ApiException as err:
        if err.status == 403:
            return True
        raise
    return False


def _can(controlplane, user: str, verb: str, resource: str, namespace: str | None = None, group: str = "",
         subresource: str = "", groups: tuple[str, ...] = ()) -> bool:
    """The server's own authorization decision for an impersonated user (a SelfSubjectAccessReview as them)."""
    with controlplane.api_client(impersonate=user, groups=groups) as api:
        review = client.AuthorizationV1Api(api).create_self_subject_access_review(client.V1SelfSubjectAccessReview(
            spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=client.V1ResourceAttributes(
                verb=verb, resource=resource, group=group, subresource=subresource or None, namespace=namespace))))
        return bool(review.status.allowed)


def _deployment(name: str, namespace: str) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": name}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}}, "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0",
                                     "args": ["--config", "/etc/kvtier/engine.yaml"]}]}}},
    }


def test_helm_installed_what_it_rendered(controlplane, release):
    with controlplane.api_client() as api:
        apps, rbac = client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
        deployment = apps.read_namespaced_deployment(release.fullname, release.namespace)
        assert deployment.spec.template.spec.service_account_name == release.fullname
        assert rbac.read_cluster_role(f"{release.fullname}-cluster").rules
        assert rbac.read_namespaced_role(f"{release.fullname}-slo-secrets", release.serving).rules
        # The peering object: its CRD came from the chart's crds/ directory, which Helm installs first.
        custom = client.CustomObjectsApi(api)
        assert custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", release.fullname)


def test_operator_applies_to_deployments_but_cannot_create_or_delete_them(controlplane, release):
    controlplane.apply(_deployment("llama", release.other))
    patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llama", "namespace": release.other},
             "spec": {"template": {"metadata": {"annotations": {"kvtier.io/config-hash": "abc"}}}}}
    operator = controlplane.dynamic(impersonate=release.sa)
    stored = controlplane.apply(patch, field_manager=FIELD_MANAGER, dynamic=operator)
    assert stored["spec"]["template"]["metadata"]["annotations"]["kvtier.io/config-hash"] == "abc"
    managers = {m["manager"] for m in stored["metadata"]["managedFields"]}
    assert FIELD_MANAGER in managers
    with controlplane.api_client(impersonate=release.sa) as api:
        apps = client.AppsV1Api(api)
        assert apps.read_namespaced_deployment("llama", release.other).metadata.name == "llama"
        assert _denied(apps.delete_namespaced_deployment, "llama", release.other)
        body = _deployment("forbidden", release.other)
        assert _denied(apps.create_namespaced_deployment, release.other, body)


def test_operator_manages_configmaps_and_posts_events(controlplane, release):
    # The operator's own client, as the ServiceAccount: the ConfigMap is created and changed by server-side
    # apply and removed on release, exactly the calls handlers.py makes.
    from kvtier_operator.kube import Kube, config_map_path

    kube = Kube(str(controlplane.kubeconfig))
    kube.api.set_default_header("Impersonate-User", release.sa)
    try:
        path = config_map_path(release.other, "kvtier-llama")
        for value in ("a: 1\n", "a: 2\n"):
            stored = kube.apply(path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
                "name": "kvtier-llama", "namespace": release.other}, "data": {"engine.yaml": value}})
            assert stored["data"]["engine.yaml"] == value
        assert kube.delete(path) and not kube.delete(path)  # the second: already gone, not an error
    finally:
        kube.close()
    with controlplane.api_client(impersonate=release.sa) as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_event(release.other, client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name="kvtier-"), reason="TierDisabled", message="test",
            type="Warning", involved_object=client.V1ObjectReference(kind="KVCachePolicy", name="llama",
                                                                      namespace=release.other)))
        assert core.list_node().items is not None
        # Least privilege: what the operator never does is refused.
        assert _denied(core.list_namespaced_config_map, release.other)
        assert _denied(core.list_namespaced_pod, release.other)
        assert _denied(core.create_namespaced_pod, release.other, client.V1Pod(
            metadata=client.V1ObjectMeta(name="x"), spec=client.V1PodSpec(containers=[client.V1Container(
                name="x", image="busybox:1.37.0")])))


def test_operator_reads_secrets_only_where_slo_auth_secrets_says(controlplane, release):
    with controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        for ns in (release.serving, release.other, release.namespace):
            core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="prom-token"),
                                                              string_data={"token": "t"}))
    with controlplane.api_client(impersonate=release.sa) as api:
        core = client.CoreV1Api(api)
        assert core.read_namespaced_secret("prom-token", release.serving).data["token"]
        assert _denied(core.read_namespaced_secret, "prom-token", release.other)
        assert _denied(core.read_namespaced_secret, "prom-token", release.namespace)
        # get on a named Secret, never list or watch (which would reveal every Secret in the namespace).
        assert _denied(core.list_namespaced_secret, release.serving)
        assert _denied(core.list_secret_for_all_namespaces)


def test_operator_works_policies_status_and_finalizers_but_does_not_create_them(controlplane, release):
    policy = {"apiVersion": "kvtier.io/v1alpha1", "kind": "KVCachePolicy",
              "metadata": {"name": "llama", "namespace": release.other},
              "spec": {"selector": {"matchLabels": {"app": "llama"}}, "engine": "vllm",
                       "tiers": [{"name": "host", "medium": "cpu", "size": "8Gi"}]}}
    controlplane.apply(policy)
    group, version, plural = "kvtier.io", "v1alpha1", "kvcachepolicies"
    with controlplane.api_client(impersonate=release.sa) as api:
        custom = client.CustomObjectsApi(api)
        assert custom.list_cluster_custom_object(group, version, plural)["items"]
        custom.patch_namespaced_custom_object(group, version, release.other, plural, "llama",
                                              {"metadata": {"finalizers": ["kvtier.io/cleanup"]}})
        custom.patch_namespaced_custom_object_status(group, version, release.other, plural, "llama",
                                                     {"status": {"sloState": "Off"}})
        assert _denied(custom.create_namespaced_custom_object, group, version, release.other, plural,
                       {**policy, "metadata": {"name": "other", "namespace": release.other}})
        assert _denied(custom.delete_namespaced_custom_object, group, version, release.other, plural, "llama")
        custom.patch_namespaced_custom_object(group, version, release.other, plural, "llama",
                                              {"metadata": {"finalizers": None}})
    with controlplane.api_client() as api:
        status = client.CustomObjectsApi(api).get_namespaced_custom_object(group, version, release.other, plural,
                                                                           "llama")
        assert status["status"]["sloState"] == "Off"


@pytest.mark.parametrize("verb, resource, group, subresource", [
    ("create", "clusterrolebindings", "rbac.authorization.k8s.io", ""),
    ("escalate", "clusterroles", "rbac.authorization.k8s.io", ""),
    ("impersonate", "users", "", ""),
    ("create", "serviceaccounts", "", "token"),
    ("get", "pods", "", "exec"),
    ("create", "pods", "", "exec"),
    ("patch", "nodes", "", ""),
    ("delete", "customresourcedefinitions", "apiextensions.k8s.io", ""),
    ("create", "customresourcedefinitions", "apiextensions.k8s.io", ""),
    ("update", "deployments", "apps", "scale"),
    ("patch", "daemonsets", "apps", ""),
    ("create", "mutatingwebhookconfigurations", "admissionregistration.k8s.io", ""),
])
def test_operator_cannot_escalate(controlplane, release, verb, resource, group, subresource):
    assert not _can(controlplane, release.sa, verb, resource, release.other, group, subresource)


def test_aggregated_roles_let_users_view_and_edit_policies(controlplane, release):
    # Bind two people to the built-in roles in one namespace; kube-controller-manager folds the chart's
    # aggregated ClusterRoles into `view` and `edit`.
    ns = release.other
    with controlplane.api_client() as api:
        rbac = client.RbacAuthorizationV1Api(api)
        for user, role in (("viewer@example.com", "view"), ("editor@example.com", "edit")):
            rbac.create_namespaced_role_binding(ns, client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name=f"{role}-{user.split('@')[0]}"),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
                subjects=[client.RbacV1Subject(kind="User", name=user, api_group="rbac.authorization.k8s.io")]))
    deadline = time.monotonic() + 60
    while not (_can(controlplane, "editor@example.com", "create", "kvcachepolicies", ns, "kvtier.io")
               and _can(controlplane, "viewer@example.com", "list", "kvcachepolicies", ns, "kvtier.io")):
        assert time.monotonic() < deadline, "aggregation into view/edit did not happen within 60 s"
        time.sleep(0.5)
    assert not _can(controlplane, "viewer@example.com", "create", "kvcachepolicies", ns, "kvtier.io")
    assert not _can(controlplane, "editor@example.com", "patch", "kvcachepolicies", ns, "kvtier.io", "status")
    assert not _can(controlplane, "editor@example.com", "list", "kvcachepolicies", release.serving, "kvtier.io")


def test_watch_namespaces_confines_the_operator(helm, controlplane):
    with controlplane.api_client() as api:
        core = client.CoreV1Api(api)
        op, watched, unwatched = (_namespace(core, p) for p in ("kvtier-op-", "kvtier-watched-", "kvtier-not-"))
    name = f"kvt-{uuid.uuid4().hex[:6]}"
    values = Path(helm.env["HELM_CACHE_HOME"]) / f"{name}.json"
    values.write_text(json.dumps({"crds": {"enabled": False}, "operator": {"watchNamespaces": [watched]}}))
    _helm(helm, controlplane, "install", name, str(CHART), "--namespace", op, "--values", str(values))
    try:
        sa = f"system:serviceaccount:{op}:{name}-kvtier"
        assert _can(controlplane, sa, "patch", "deployments", watched, "apps")
        assert _can(controlplane, sa, "patch", "kvcachepolicies", watched, "kvtier.io", "status")
        assert not _can(controlplane, sa, "patch", "deployments", unwatched, "apps")
        assert _can(controlplane, sa, "patch", "configmaps", watched)
        assert not _can(controlplane, sa, "patch", "configmaps", unwatched)
        assert _can(controlplane, sa, "list", "nodes")
    finally:
        _helm(helm, controlplane, "uninstall", name, "--namespace", op)
        with controlplane.api_client() as api:
            for ns in (op, watched, unwatched):
                client.CoreV1Api(api).delete_namespace(ns)


def test_second_release_and_uninstall_keep_shared_crds_and_remove_rbac(helm, controlplane, release):
    # A second release with peering in the same cluster: kopf's CRDs exist already (Helm skips them), and its
    # peering object has a name of its own. Uninstalling it removes its RBAC and leaves the shared CRDs.
    with controlplane.api_client() as api:
        op = _namespace(client.CoreV1Api(api), "kvtier-op-")
    name = f"kvt-{uuid.uuid4().hex[:6]}"
    values = Path(helm.env["HELM_CACHE_HOME"]) / f"{name}.json"
    values.write_text(json.dumps({"crds": {"enabled": False}, "peering": {"enabled": True}}))
    _helm(helm, controlplane, "upgrade", "--install", name, str(CHART), "--namespace", op, "--values", str(values))
    _helm(helm, controlplane, "uninstall", name, "--namespace", op)
    with controlplane.api_client() as api:
        ext, rbac = client.ApiextensionsV1Api(api), client.RbacAuthorizationV1Api(api)
        assert ext.read_custom_resource_definition("clusterkopfpeerings.kopf.dev")  # kept
        with pytest.raises(ApiException) as err:
            rbac.read_cluster_role(f"{name}-kvtier-cluster")
        assert err.value.status == 404
        client.CoreV1Api(api).delete_namespace(op)
