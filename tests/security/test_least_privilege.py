"""A policy author cannot reach beyond their rights through the operator (issue #16, security items 1, 2, 4, 6).

On the real API server, as user "mallory", whose only rights are on KVCachePolicy objects in one namespace; the
operator runs with the admin settings of tests/plugins/operator.py (hostPath under /mnt/disks; Prometheus on
127.0.0.1 over http) unless a test says otherwise.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest
from kvtier_operator.kube import ApiError, Kube, config_map_path, policy_path, workload_path
from kvtier_operator.labels import OPT_IN_LABEL
from kvtier_operator.settings import POLICY_LABEL
from plugins.operator import cond, deployment, get_policy, get_workload, make_policy, user_apply, wait_applied, wait_for

pytestmark = pytest.mark.controlplane
AUTHOR = "mallory"
CPU = {"name": "cpu", "medium": "cpu", "size": "1Gi"}


@pytest.fixture
def author(kube, namespace, controlplane):
    """A client impersonating a user who may only manage KVCachePolicy objects in the test's namespace."""
    rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
    kube.create(f"{rbac}/roles", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "policy-author"},
        "rules": [{"apiGroups": ["kvtier.io"], "resources": ["kvcachepolicies"],
                   "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]}]})
    kube.create(f"{rbac}/rolebindings", {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "policy-author"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "policy-author"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": AUTHOR}]})
    client = Kube(str(controlplane.kubeconfig))
    client.api.set_default_header("Impersonate-User", AUTHOR)

    def may_create() -> bool:
        review = client.create("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", {
            "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": {"namespace": namespace, "verb": "create", "group": "kvtier.io",
                                            "resource": "kvcachepolicies"}}})
        return bool(review.get("status", {}).get("allowed"))

    # The API server's RBAC authorizer reads bindings from its informer cache: a binding just created may not be
    # in force yet, and the author's first create would then be refused for the wrong reason (403, not the 422 of
    # the rule under test). Wait until the server itself says the author may create policies.
    wait_for(may_create, timeout=30, what=f"the RoleBinding to let {AUTHOR} create kvcachepolicies")
    yield client
    client.close()


def unchanged(kube, namespace: str, name: str, before: dict) -> bool:
    now = get_workload(kube, namespace, name)
    return (now["metadata"]["generation"] == before["metadata"]["generation"]
            and now["spec"]["template"] == before["spec"]["template"]
            and POLICY_LABEL not in (now["metadata"].get("labels") or {}))


def test_the_author_really_cannot_edit_workloads(kube, namespace, author):
    user_apply(kube, deployment("db", namespace, opt_in=None))
    for attempt in (lambda: author.patch(workload_path("Deployment", namespace, "db"),
                                         {"metadata": {"labels": {OPT_IN_LABEL: "true"}}}),
                    lambda: author.get(workload_path("Deployment", namespace, "db"))):
        with pytest.raises(ApiError) as denied:
            attempt()
        assert denied.value.status == 403
    author.create(policy_path(namespace), make_policy("probe", namespace))  # what the author may do


def test_a_workload_that_did_not_opt_in_is_not_touched(kube, namespace, author, run_operator):
    before = user_apply(kube, deployment("db", namespace, opt_in=None, args=["--model", "m"]))
    run_operator()
    # Everything the issue injected: a cpu tier (memory limit, /dev/shm, an init container), a disk tier, and
    # managed args.
    author.create(policy_path(namespace), make_policy(
        "db", namespace, engine="vllm", injection={"args": "managed"},
        tiers=[CPU, {"name": "disk", "medium": "filesystem", "size": "1Gi", "path": "/mnt/kv",
                     "volume": {"emptyDir": {}}}]))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "db")) and
                   cond(p, "Ready").get("reason") == "NotOptedIn" and p, 30, what="NotOptedIn")
    assert f"{OPT_IN_LABEL}: db" in cond(pol, "Ready")["message"]
    time.sleep(1)
    assert unchanged(kube, namespace, "db", before)
    # Opted in to another policy is no consent either.
    user_apply(kube, deployment("db", namespace, opt_in="other", args=["--model", "m"]))
    time.sleep(1.5)
    assert get_workload(kube, namespace, "db")["spec"]["template"] == before["spec"]["template"]


def test_host_paths_outside_the_admins_prefixes_are_refused(kube, namespace, author, run_operator):
    before = user_apply(kube, deployment("llm", namespace))  # opted in: the owner consents to kvtier
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace, tiers=[
        CPU, {"name": "root", "medium": "filesystem", "size": "1Gi", "path": "/mnt/host",
              "volume": {"hostPath": {"path": "/"}}}]))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Ready").get("reason") == "HostPathNotAllowed" and p, 30, what="HostPathNotAllowed")
    assert "spec.tiers[1].volume.hostPath.path" in cond(pol, "Ready")["message"]
    time.sleep(1)
    assert unchanged(kube, namespace, "llm", before)
    # Under the admin's prefix, the same policy applies.
    author.request("PATCH", policy_path(namespace, "llm"), body={"spec": {"tiers": [
        CPU, {"name": "root", "medium": "filesystem", "size": "1Gi", "path": "/mnt/host",
              "volume": {"hostPath": {"path": "/mnt/disks/kv"}}}]}}, content_type="application/merge-patch+json")
    wait_applied(kube, namespace, "llm", "llm")


@pytest.mark.parametrize("path", ["/var/run/secrets/kubernetes.io/serviceaccount", "/etc/kvtier", "/dev/shm", "/",
                                  "/etc", "/mnt/../etc"])
def test_mount_paths_over_system_paths_are_refused_at_admission(namespace, author, path):
    with pytest.raises(ApiError) as refused:
        author.create(policy_path(namespace), make_policy("p", namespace, tiers=[
            CPU, {"name": "d", "medium": "filesystem", "size": "1Gi", "path": path, "volume": {"emptyDir": {}}}]))
    assert refused.value.status == 422 and "spec.tiers[1].path" in refused.value.message


def test_nothing_is_applied_while_the_config_argument_is_missing(kube, namespace, author, run_operator):
    before = user_apply(kube, deployment("llm", namespace, args=["--model", "m"]))
    run_operator()
    author.create(policy_path(namespace), make_policy("llm", namespace))
    wait_for(lambda: cond(get_policy(kube, namespace, "llm"), "Ready").get("reason") == "MissingConfigArgument",
             30, what="MissingConfigArgument")
    time.sleep(1)
    assert unchanged(kube, namespace, "llm", before)


def test_release_deletes_only_a_config_map_kvtier_owns(kube, namespace, author, run_operator):
    kube.create(f"/api/v1/namespaces/{namespace}/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kvtier-victim"}, "data": {"db.conf": "x"}})
    run_operator()
    # Selects nothing and names no engine: nothing is rendered, so the operator never writes the ConfigMap.
    author.create(policy_path(namespace), make_policy("victim", namespace, selector={"matchLabels": {"app": "none"}}))
    wait_for(lambda: cond(get_policy(kube, namespace, "victim"), "Ready").get("reason") == "NoTargets", 30,
             what="the policy reconciled")
    author.delete(policy_path(namespace, "victim"))
    wait_for(lambda: get_policy(kube, namespace, "victim") is None, 30, what="the policy released")
    assert kube.get(config_map_path(namespace, "kvtier-victim"))["data"] == {"db.conf": "x"}


class Listener:
    """Accepts connections on 127.0.0.1 and records what arrives (a stand-in for an attacker's endpoint)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.received: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 11\r\n\r\nINTERNAL-42")
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


def _token_secret(kube, namespace: str) -> None:
    kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "prom-token"},
        "stringData": {"token": "s3cret-token"}})


def _slo_policy(name: str, namespace: str, url: str, secret: str = "prom-token", key: str = "token") -> dict:
    return make_policy(name, namespace, slo={"prometheus": {"url": url, "timeout": "1s",
                                                            "auth": {"bearerToken": {"name": secret, "key": key}}},
                                             "ttftP99": "2s", "interval": "1s"})


def test_credentials_go_only_to_endpoints_the_admin_allowed(kube, namespace, author, run_operator, listener):
    _token_secret(kube, namespace)
    run_operator(prometheus_allowed=("prometheus.monitoring.svc",), prometheus_allow_http=False)
    author.create(policy_path(namespace), _slo_policy("exfil", namespace, listener.url))
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "exfil")) and
                   cond(p, "SLOUnknown").get("status") == "True" and p, 30, what="SLOUnknown")
    message = cond(pol, "SLOUnknown")["message"]
    assert "not a Prometheus endpoint the operator's admin allows" in message, message
    time.sleep(2.5)  # a few more intervals
    assert listener.received == []  # not a single connection, so no token either


def test_an_allowed_endpoint_gets_the_token_but_its_answer_is_not_reflected(kube, namespace, author,
                                                                              run_operator, listener):
    _token_secret(kube, namespace)
    user_apply(kube, deployment("allowed", namespace))  # the guard measures only the policy's own pods
    run_operator()  # the fixture's admin allows 127.0.0.1 over http
    author.create(policy_path(namespace), _slo_policy("allowed", namespace, listener.url))
    wait_for(lambda: listener.received, 30, what="the allowed endpoint queried")
    assert b"Authorization: Bearer s3cret-token" in listener.received[0]
    pol = wait_for(lambda: (p := get_policy(kube, namespace, "allowed")) and
                   (p.get("status") or {}).get("slo", {}).get("reason") and p, 30, what="an evaluation")
    everything = str(pol["status"])
    events = kube.list(f"/api/v1/namespaces/{namespace}/events")
    assert "INTERNAL-42" not in everything and "INTERNAL-42" not in str(events)
    assert "s3cret-token" not in everything and "s3cret-token" not in str(events)


def test_conditions_do_not_tell_whether_a_secret_exists(kube, namespace, author, run_operator):
    _token_secret(kube, namespace)
    for name in ("a", "b"):
        user_apply(kube, deployment(name, namespace))  # targets, so the guard does query
    run_operator()
    url = "http://127.0.0.1:9"
    author.create(policy_path(namespace), _slo_policy("a", namespace, url, secret="prom-token", key="nokey"))
    author.create(policy_path(namespace), _slo_policy("b", namespace, url, secret="nosecret", key="nokey"))
    messages = {}
    for name, secret in (("a", "prom-token"), ("b", "nosecret")):
        pol = wait_for(lambda name=name: (p := get_policy(kube, namespace, name)) and
                       cond(p, "SLOUnknown").get("status") == "True" and p, 30, what=f"SLOUnknown on {name}")
        messages[name] = cond(pol, "SLOUnknown")["message"].replace(secret, "SECRET")
    assert messages["a"] == messages["b"], messages
