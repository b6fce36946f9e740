"""Secrets by consent: a remote tier's passwordSecret, macKeySecret and caSecret reach the serving pods only if the
Secret carries the kvtier.io/remote-stores annotation listing the tier's store, scheme, host and port (set by
someone who may edit Secrets; a policy author who may edit only KVCachePolicies cannot), and only from namespaces
the admin lists. Never a service-account token, never a private key (by name or by content, in any Secret type), a
CA bundle of certificates only, a tenant key of at least 32 bytes that is no credential of the store. Before, a
policy could project any Secret of its namespace (another app's database password, a token, a TLS key as ca.crt)
into pods, and the password was sent to the store."""
from __future__ import annotations

import base64
import copy

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.controller import Operator
from kvtier_operator.kube import policy_path, secret_path, workload_path
from kvtier_operator.labels import REMOTE_STORES_ANNOTATION
from kvtier_operator.settings import Settings
from kvtier_operator.status import condition
from plugins.operator import deployment, observed, policy
from security.test_least_privilege import author  # noqa: F401 - fixture
from security.test_trust_revocation import FakeKube

NOW = "2026-12-01T08:00:00Z"
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}
STORE = "rediss://valkey.kv:6379/0"
ALLOWED = ("valkey.kv:6379",)
MAC_KEY = b"k" * 32


def secret(name: str, data: dict[str, bytes], *, stores: str | None = "valkey.kv:6379",
           kind: str = "Opaque") -> dict:
    meta: dict = {"name": name, "namespace": "default"}
    if stores is not None:
        meta["annotations"] = {REMOTE_STORES_ANNOTATION: stores}
    return {"apiVersion": "v1", "kind": "Secret", "type": kind, "metadata": meta,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


GOOD = {"valkey": secret("valkey", {"password": b"s3cret"}), "kv-mac": secret("kv-mac", {"mac": MAC_KEY}),
        "valkey-tls": secret("valkey-tls", {"ca.crt": b"-----BEGIN CERTIFICATE-----", "tls.key": b"private"},
                             kind="kubernetes.io/tls")}


def remote_policy(**store) -> dict:
    store = store or {"passwordSecret": {"name": "valkey", "key": "password"},
                      "macKeySecret": {"name": "kv-mac", "key": "mac"},
                      "caSecret": {"name": "valkey-tls", "key": "ca.crt"}}
    tier = {"name": "shared", "medium": "remote", "size": "8Gi", "remote": {"url": STORE, **store}}
    return policy(tiers=[CPU, tier], backend="kvtier", engine="vllm")


def plan(pol: dict, secrets: dict, allowed=ALLOWED, namespaces=("default",)) -> rc.Plan:
    return rc.plan(pol, [observed(deployment())], [], now=NOW, remote_stores_allowed=allowed, secrets=secrets,
                   secret_namespaces=namespaces)


def test_secrets_marked_for_the_store_are_projected():
    p = plan(remote_policy(), GOOD)
    assert not p.invalid and p.targets[0].apply is not None


def with_(name: str, obj) -> dict:
    return {**GOOD, name: obj}


MAC_REF = {"name": "kv-mac", "key": "mac"}
PW_REF = {"name": "valkey", "key": "password"}
PEM_KEY = b"-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIB\n-----END EC PRIVATE KEY-----\n"
PKCS8_KEY = b"-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----\n"
CERT = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
CASES = {
    # field, secrets the operator read, policy's store refs, what the condition says
    "password not marked": ("passwordSecret", with_("valkey", secret("valkey", {"password": b"x"}, stores=None)),
                            None, "is not marked for the store rediss://valkey.kv:6379"),
    "marked for another store": ("passwordSecret",
                                 with_("valkey", secret("valkey", {"password": b"x"}, stores="other:6379")),
                                 None, "is not marked for the store"),
    "marked for another port": ("passwordSecret",
                                with_("valkey", secret("valkey", {"password": b"x"}, stores="valkey.kv:6380")),
                                None, "is not marked for the store"),
    "missing Secret reads as unmarked": ("passwordSecret", with_("valkey", None), None, "is not marked"),
    "service-account token": ("passwordSecret",
                              with_("valkey", secret("valkey", {"password": b"tok"},
                                                     kind="kubernetes.io/service-account-token")),
                              None, "service-account token"),
    "TLS private key as CA": ("caSecret", GOOD, {"passwordSecret": {"name": "valkey", "key": "password"},
                                                 "macKeySecret": MAC_REF,
                                                 "caSecret": {"name": "valkey-tls", "key": "tls.key"}},
                              "is named as a private key (*.key)"),
    "private key named *.key in an Opaque Secret": (
        "caSecret", with_("valkey-tls", secret("valkey-tls", {"ca.crt": CERT, "tls.key": PEM_KEY})),
        {"passwordSecret": PW_REF, "macKeySecret": MAC_REF, "caSecret": {"name": "valkey-tls", "key": "tls.key"}},
        "is named as a private key"),
    "PEM private key content as the CA bundle": (
        "caSecret", with_("valkey-tls", secret("valkey-tls", {"ca.crt": CERT + PKCS8_KEY})), None,
        "holds a private key"),
    "PEM private key content as the password": (
        "passwordSecret", with_("valkey", secret("valkey", {"password": PEM_KEY})), None, "holds a private key"),
    "a CA bundle that is not PEM certificates": (
        "caSecret", with_("valkey-tls", secret("valkey-tls", {"ca.crt": b"not a certificate"})), None,
        "must be a PEM CA bundle: CERTIFICATE blocks only"),
    "a CA bundle with another PEM block": (
        "caSecret", with_("valkey-tls", secret("valkey-tls", {"ca.crt": CERT + b"-----BEGIN PUBLIC KEY-----\nx\n"})),
        None, "CERTIFICATE blocks only"),
    "previous tenant key too short": (
        "macKeySecret.previousKey", with_("kv-mac", secret("kv-mac", {"mac": MAC_KEY, "mac.previous": b"k" * 31})),
        None, "at least 32 bytes (the previous tenant key)"),
    "short MAC key": ("macKeySecret", with_("kv-mac", secret("kv-mac", {"mac": b"k" * 31})), None,
                      "at least 32 bytes"),
    "absent key": ("macKeySecret", GOOD, {"passwordSecret": {"name": "valkey", "key": "password"},
                                          "macKeySecret": {"name": "kv-mac", "key": "other"}}, "has no key 'other'"),
    "empty password": ("passwordSecret", with_("valkey", secret("valkey", {"password": b""})), None,
                       "at least 1 bytes"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_secret_without_consent_is_refused_with_a_condition_naming_field_and_rule(case):
    field, secrets, refs, words = CASES[case]
    p = plan(remote_policy(**(refs or {})), secrets)
    assert p.invalid and p.targets == [] and p.config_map is None, "nothing is applied"
    ready = condition(p.status, "Ready")
    assert ready["reason"] == "SecretNotAllowed"
    assert f"spec.tiers[1].remote.{field}: " in ready["message"] and words in ready["message"], ready["message"]


STORE_PW = b"the-store-password-that-is-32-bytes-long"
SAME_BYTES = {
    # The store password's bytes as the tenant key, from another Secret, from the same Secret under another key,
    # as the previous tenant key, and the ACL username's.
    "another Secret": ({"valkey": secret("valkey", {"password": STORE_PW}),
                        "kv-mac": secret("kv-mac", {"mac": STORE_PW})}, {}, "macKeySecret", "passwordSecret"),
    "the same Secret": ({"valkey": secret("valkey", {"password": STORE_PW, "mac": STORE_PW})},
                        {"macKeySecret": {"name": "valkey", "key": "mac"}}, "macKeySecret", "passwordSecret"),
    "the previous key": ({"valkey": secret("valkey", {"password": STORE_PW}),
                          "kv-mac": secret("kv-mac", {"mac": MAC_KEY, "mac.previous": STORE_PW})}, {},
                         "macKeySecret.previousKey", "passwordSecret"),
    "the username": ({"kv-mac": secret("kv-mac", {"mac": b"tenant-a-user-name-of-32-bytes-xx"})},
                     {"username": "tenant-a-user-name-of-32-bytes-xx"}, "macKeySecret", "username"),
}


@pytest.mark.parametrize("case", SAME_BYTES, ids=list(SAME_BYTES))
def test_the_tenant_key_is_never_a_credential_of_the_store(case):
    read, store, field, other = SAME_BYTES[case]
    refs = {"passwordSecret": PW_REF, "macKeySecret": MAC_REF, **store}
    p = plan(remote_policy(**refs), {**GOOD, **read})
    assert p.invalid and p.targets == [] and p.config_map is None, "nothing is applied"
    ready = condition(p.status, "Ready")
    assert ready["reason"] == "SecretNotAllowed"
    assert (f"spec.tiers[1].remote.{field}: holds the same bytes as spec.tiers[1].remote.{other}: the tenant key is "
            "never a credential of the store") in ready["message"], ready["message"]
    assert STORE_PW.decode() not in ready["message"], "the value itself is never reported"


def test_a_mark_admits_only_the_scheme_host_and_port_it_names():
    plain = {"name": "shared", "medium": "remote", "size": "8Gi",
             "remote": {"url": "redis://valkey.kv:6379", "passwordSecret": PW_REF, "macKeySecret": MAC_REF}}
    pol = policy(tiers=[CPU, plain], backend="kvtier", engine="vllm")
    allowed = ("redis://valkey.kv:6379",)
    for tls_only in ("valkey.kv:6379", "rediss://valkey.kv:6379"):
        marked = {n: secret(n, v, stores=tls_only) for n, v in (("valkey", {"password": b"x"}),
                                                                ("kv-mac", {"mac": MAC_KEY}))}
        ready = condition(plan(pol, marked, allowed).status, "Ready")
        assert ready["reason"] == "SecretNotAllowed", f"a TLS-only mark {tls_only!r} let the password cross plain TCP"
        assert 'kvtier.io/remote-stores: "redis://valkey.kv:6379"' in ready["message"], ready["message"]
    marked = {n: secret(n, v, stores="redis://valkey.kv:6379") for n, v in (("valkey", {"password": b"x"}),
                                                                          ("kv-mac", {"mac": MAC_KEY}))}
    assert not plan(pol, marked, allowed).invalid
    # A mark naming a database admits that database only.
    db1 = {n: secret(n, v, stores="redis://valkey.kv:6379/1") for n, v in (("valkey", {"password": b"x"}),
                                                                         ("kv-mac", {"mac": MAC_KEY}))}
    assert plan(pol, db1, allowed).invalid
    # And a mark for plain TCP does not admit the TLS store either (it was given for another channel).
    tls = remote_policy()
    assert plan(tls, {**GOOD, "valkey": secret("valkey", {"password": b"x"}, stores="redis://valkey.kv:6379")}).invalid


def test_secrets_of_a_namespace_the_admin_did_not_list_are_refused_before_any_read():
    p = plan(remote_policy(), GOOD, namespaces=("serving",))
    ready = condition(p.status, "Ready")
    assert p.invalid and ready["reason"] == "SecretNotAllowed"
    for field in ("passwordSecret", "macKeySecret", "caSecret"):
        assert (f"spec.tiers[1].remote.{field}: Secrets of namespace 'default' are not ones the operator's admin "
                "lets remote tiers use (operator setting remoteSecretNamespaces)") in ready["message"]


def test_missing_unreadable_and_unmarked_secrets_read_the_same():
    # The author may not read Secrets: the condition must not tell which exist.
    unmarked = plan(remote_policy(), with_("valkey", secret("valkey", {"password": b"x"}, stores=None)))
    missing = plan(remote_policy(), with_("valkey", None))
    assert condition(unmarked.status, "Ready")["message"] == condition(missing.status, "Ready")["message"]


def test_the_annotation_lists_stores_and_ipv6_hosts_in_brackets():
    listed = with_("valkey", secret("valkey", {"password": b"x"}, stores="a:1, VALKEY.kv:6379 ,b:2"))
    assert not plan(remote_policy(), listed).invalid
    six = {"pw": secret("pw", {"p": b"p" * 32, "tenant": b"t" * 32}, stores="[fd00::1]:6379")}
    tier = {"name": "shared", "medium": "remote", "size": "8Gi",
            "remote": {"url": "rediss://[fd00::1]:6379", "passwordSecret": {"name": "pw", "key": "p"},
                       "macKeySecret": {"name": "pw", "key": "tenant"}}}
    pol = policy(tiers=[CPU, tier], backend="kvtier", engine="vllm")
    p = rc.plan(pol, [observed(deployment())], [], now=NOW, remote_stores_allowed=("[fd00::1]:6379",), secrets=six)
    assert not p.invalid, condition(p.status, "Ready")


def operator_reading(objects: dict, secret_namespaces: tuple[str, ...]) -> tuple[FakeKube, list[str], Operator]:
    """An operator over a fake API server holding ``objects``, and the list of paths it reads."""
    kube = FakeKube(copy.deepcopy(objects))
    reads: list[str] = []
    get = kube.get
    kube.get = lambda path: reads.append(path) or get(path)
    settings = Settings(read_nodes=False, remote_stores_allowed=ALLOWED, remote_secret_namespaces=secret_namespaces)
    return kube, reads, Operator(settings, kube)


def test_the_operator_reads_only_the_named_secrets_and_applies_nothing_without_consent():
    pol = remote_policy()
    pol["metadata"]["resourceVersion"] = "10"
    w_path = workload_path("Deployment", "default", "llm")
    unmarked = secret("valkey", {"password": b"x"}, stores=None)
    objects = {policy_path("default", "llm"): pol, w_path: observed(deployment()),
               secret_path("default", "valkey"): unmarked, secret_path("default", "kv-mac"): GOOD["kv-mac"],
               secret_path("default", "valkey-tls"): GOOD["valkey-tls"],
               secret_path("default", "db-password"): secret("db-password", {"p": b"x"})}
    kube, reads, op = operator_reading(objects, ("default",))
    op.run_pass("default", "llm", [])
    assert kube.applied == [], "no workload written, no ConfigMap"
    assert {r for r in reads if "/secrets/" in r} == {secret_path("default", n) for n in ("valkey", "kv-mac",
                                                                                           "valkey-tls")}
    stored = kube.objects[policy_path("default", "llm")]
    assert condition(stored["status"], "Ready")["reason"] == "SecretNotAllowed"

    # Someone who may edit Secrets marks it: the recheck sees the change, and the next pass applies.
    assert not op.secrets_changed("default", "llm")
    kube.objects[secret_path("default", "valkey")] = {**GOOD["valkey"], "metadata": {
        **GOOD["valkey"]["metadata"], "resourceVersion": "11"}}
    assert op.secrets_changed("default", "llm")
    op.run_pass("default", "llm", [])
    assert [p for p, _ in kube.applied if p == w_path]
    assert not op.secrets_changed("default", "llm")
    del kube.objects[secret_path("default", "valkey")]
    assert op.secrets_changed("default", "llm"), "a deleted Secret is a change"


def test_the_operator_reads_no_secret_of_a_namespace_the_admin_did_not_list():
    """The SLO guard's Role (or any other) may let the operator read a namespace's Secrets: that grants a remote tier
    nothing. The list is checked before any read, and the condition names the setting."""
    pol = remote_policy()
    pol["metadata"]["resourceVersion"] = "10"
    objects = {policy_path("default", "llm"): pol, workload_path("Deployment", "default", "llm"):
               observed(deployment()), **{secret_path("default", n): s for n, s in GOOD.items()}}
    kube, reads, op = operator_reading(objects, ("serving",))
    op.run_pass("default", "llm", [])
    assert kube.applied == [] and not [r for r in reads if "/secrets/" in r]
    ready = condition(kube.objects[policy_path("default", "llm")]["status"], "Ready")
    assert ready["reason"] == "SecretNotAllowed" and "remoteSecretNamespaces" in ready["message"]


def test_consent_withdrawn_releases_what_was_applied():
    from security.test_trust_revocation import _applied

    wl, pol = _applied(remote_policy(), {"remote_stores_allowed": ALLOWED, "secrets": GOOD})
    unmarked = with_("valkey", secret("valkey", {"password": b"x"}, stores=None))
    p = rc.plan(pol, [wl], [], now=NOW, remote_stores_allowed=ALLOWED, secrets=unmarked)
    [t] = p.targets
    assert t.remove and t.state == rc.RELEASED
    assert [e.reason for e in p.events] == ["SecretNotAllowed"]


@pytest.mark.controlplane
def test_on_a_real_api_server_only_a_marked_secret_is_projected_and_unmarking_it_releases(kube, namespace, author,
                                                                                         run_operator):
    """The probe's set-up: the policy's author may edit only KVCachePolicies; another app's Secret in the namespace
    is not projected, the owner's mark lets it through, and taking the mark away takes the projection back."""
    from plugins.operator import cond, get_policy, get_workload, make_policy, user_apply, wait_applied, wait_for

    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    kube.create(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db-password"},
                          "stringData": {"password": "the-database-password-of-another-app"}})
    kube.create(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kv-mac"},
                          "stringData": {"mac": MAC_KEY.decode()}})
    user_apply(kube, deployment("llm", namespace))
    # The operator watches no Secret: it reads the named ones again every secret_recheck_seconds (here 1 s; the
    # resync stays at its 5 minutes) and runs a pass when one changed.
    run_operator(remote_stores_allowed=ALLOWED, remote_secret_namespaces=(namespace,), secret_recheck_seconds=1.0)
    tier = {"name": "shared", "medium": "remote", "size": "1Gi",
            "remote": {"url": STORE, "passwordSecret": {"name": "db-password", "key": "password"},
                       "macKeySecret": {"name": "kv-mac", "key": "mac"}}}
    author.create(policy_path(namespace), make_policy("llm", namespace, backend="kvtier", engine="vllm",
                                                      tiers=[CPU, tier]))

    def projected() -> list:
        volumes = get_workload(kube, namespace, "llm")["spec"]["template"]["spec"].get("volumes") or []
        return [v for v in volumes if v["name"].startswith("kvtier-remote-")]

    pol = wait_for(lambda: (p := get_policy(kube, namespace, "llm")) and
                   cond(p, "Ready").get("reason") == "SecretNotAllowed" and p, 30, what="SecretNotAllowed")
    message = cond(pol, "Ready")["message"]
    assert "spec.tiers[1].remote.passwordSecret: Secret 'db-password' is not marked" in message, message
    assert "spec.tiers[1].remote.macKeySecret" in message  # kv-mac is not marked either
    assert projected() == []

    for name in ("db-password", "kv-mac"):  # the Secrets' owner consents
        kube.patch(f"{secrets}/{name}", {"metadata": {"annotations": {REMOTE_STORES_ANNOTATION: ALLOWED[0]}}})
    wait_applied(kube, namespace, "llm", "llm")
    assert len(projected()) == 1

    kube.patch(f"{secrets}/db-password", {"metadata": {"annotations": {REMOTE_STORES_ANNOTATION: None}}})
    wait_for(lambda: projected() == [], 60, what="the projection released")
    wait_for(lambda: cond(get_policy(kube, namespace, "llm"), "Ready").get("reason") == "SecretNotAllowed", 30,
             what="SecretNotAllowed after the mark was taken away")  # the status is written after the workload
    wl = get_workload(kube, namespace, "llm")
    assert "kvtier.io/policy" not in (wl["metadata"].get("labels") or {})


@pytest.mark.controlplane
def test_through_the_operator_each_secret_rule_refuses_naming_the_field_and_the_rule(kube, namespace, run_operator):
    """The rules above as the operator applies them on a real API server: a namespace the admin did not list, the
    tenant key equal to the store password, a mark for TLS on a plain-TCP store and a private key as the password,
    each refused with Ready SecretNotAllowed naming the field and the rule, and released; each fixed, applied again
    (the Secrets are re-read every second here: no resync is waited for)."""
    from plugins.operator import cond, get_policy, make_policy, user_apply, wait_applied, wait_for

    store = "redis://valkey.kv:6379"
    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    good = {"password": base64.b64encode(b"the-store-password-of-at-least-32-bytes").decode(),
            "tenant": base64.b64encode(MAC_KEY).decode()}
    kube.create(secrets, {"apiVersion": "v1", "kind": "Secret", "metadata": {
        "name": "kv-login", "annotations": {REMOTE_STORES_ANNOTATION: store}}, "data": good})
    user_apply(kube, deployment("llm", namespace))
    tier = {"name": "shared", "medium": "remote", "size": "1Gi",
            "remote": {"url": store, "passwordSecret": {"name": "kv-login", "key": "password"},
                       "macKeySecret": {"name": "kv-login", "key": "tenant"}}}

    def refused(*words: str) -> None:
        def check():
            c = cond(get_policy(kube, namespace, "llm"), "Ready")
            return c.get("reason") == "SecretNotAllowed" and all(w in c.get("message", "") for w in words) and c
        wait_for(check, 30, what=f"SecretNotAllowed naming {words}")

    # A namespace the admin did not list: nothing is read, the condition names the setting.
    first = run_operator(remote_stores_allowed=(store,), remote_secret_namespaces=("someone-else",),
                         secret_recheck_seconds=1.0)
    kube.create(policy_path(namespace), make_policy("llm", namespace, backend="kvtier", engine="vllm",
                                                    tiers=[CPU, tier]))
    refused("spec.tiers[1].remote.passwordSecret: Secrets of namespace", "operator setting remoteSecretNamespaces")
    first.stop()
    run_operator(remote_stores_allowed=(store,), remote_secret_namespaces=(namespace,), secret_recheck_seconds=1.0)
    wait_applied(kube, namespace, "llm", "llm")

    cases = [
        ({"data": {"tenant": good["password"]}},
         ("spec.tiers[1].remote.macKeySecret: holds the same bytes as spec.tiers[1].remote.passwordSecret",
          "the tenant key is never a credential of the store")),
        ({"metadata": {"annotations": {REMOTE_STORES_ANNOTATION: "valkey.kv:6379"}}},
         ("spec.tiers[1].remote.passwordSecret: Secret 'kv-login' is not marked for the store "
          "redis://valkey.kv:6379",)),
        ({"data": {"password": base64.b64encode(PEM_KEY).decode()}},
         ("spec.tiers[1].remote.passwordSecret: key 'password' of Secret 'kv-login' holds a private key",)),
    ]
    restore = {"metadata": {"annotations": {REMOTE_STORES_ANNOTATION: store}}, "data": good}
    for patch, words in cases:
        kube.patch(f"{secrets}/kv-login", patch)
        refused(*words)
        wl = kube.get(workload_path("Deployment", namespace, "llm"))
        assert not [v for v in wl["spec"]["template"]["spec"].get("volumes") or []
                    if v["name"].startswith("kvtier-remote-")], "released while refused"
        kube.patch(f"{secrets}/kv-login", restore)
        wait_applied(kube, namespace, "llm", "llm")
