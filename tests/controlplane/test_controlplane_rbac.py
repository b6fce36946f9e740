"""Authentication and RBAC are on: a ServiceAccount gets exactly what its Role grants, checked through
impersonation (the API client's Impersonate-User header and kubectl --as) and with a real token the server's
service-account issuer signs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from plugins.controlplane import ControlPlane

pytestmark = pytest.mark.controlplane

SA = "operator"


@pytest.fixture
def operator_sa(bare_controlplane: ControlPlane, namespace: str) -> Iterator[str]:
    """A ServiceAccount bound to a namespaced Role with what an operator patching Deployments needs."""
    with bare_controlplane.api_client() as api:
        core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
        core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=SA)))
        rbac.create_namespaced_role(
            namespace,
            client.V1Role(
                metadata=client.V1ObjectMeta(name=SA),
                rules=[
                    client.V1PolicyRule(
                        api_groups=["apps"], resources=["deployments"], verbs=["get", "list", "watch", "patch"]
                    ),
                    client.V1PolicyRule(api_groups=[""], resources=["events"], verbs=["create", "patch"]),
                ],
            ),
        )
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name=SA),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=SA),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name=SA, namespace=namespace)],
            ),
        )
        core.create_namespaced_secret(
            namespace, client.V1Secret(metadata=client.V1ObjectMeta(name="model-token"), string_data={"t": "x"})
        )
    yield f"system:serviceaccount:{namespace}:{SA}"


def test_impersonated_service_account_gets_what_its_role_grants(
    bare_controlplane: ControlPlane, namespace: str, operator_sa: str
) -> None:
    with bare_controlplane.api_client(impersonate=operator_sa) as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        assert apps.list_namespaced_deployment(namespace).items == []
        for forbidden in (
            lambda: core.read_namespaced_secret("model-token", namespace),
            lambda: core.list_namespaced_secret(namespace),
            lambda: apps.list_namespaced_deployment("default"),  # a Role grants nothing outside its namespace
            lambda: apps.delete_namespaced_deployment("engine", namespace),  # verb not granted
        ):
            with pytest.raises(ApiException) as caught:
                forbidden()
            assert caught.value.status == 403
            assert operator_sa in caught.value.body


def test_kubectl_as_reports_the_same_permissions(bare_controlplane: ControlPlane, namespace: str, operator_sa: str) -> None:
    def can_i(*what: str) -> bool:
        proc = bare_controlplane.kubectl("auth", "can-i", *what, "-n", namespace, f"--as={operator_sa}", check=False)
        assert proc.stdout.strip() in ("yes", "no"), proc.stderr
        return proc.stdout.strip() == "yes"

    assert can_i("patch", "deployments.apps")
    assert not can_i("get", "secrets")
    assert not can_i("delete", "deployments.apps")
    denied = bare_controlplane.kubectl("get", "secrets", "-n", namespace, f"--as={operator_sa}", check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr


def test_service_account_token_authenticates_and_is_authorized(
    bare_controlplane: ControlPlane, namespace: str, operator_sa: str
) -> None:
    with bare_controlplane.api_client() as admin:
        token = (
            client.CoreV1Api(admin)
            .create_namespaced_service_account_token(
                SA, namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(expiration_seconds=600))
            )
            .status.token
        )
        host, ca = admin.configuration.host, admin.configuration.ssl_ca_cert
    as_token = client.Configuration(host=host, api_key={"authorization": token}, api_key_prefix={"authorization": "Bearer"})
    as_token.ssl_ca_cert = ca
    with client.ApiClient(as_token) as api:
        review = client.AuthenticationV1Api(api).create_self_subject_review(client.V1SelfSubjectReview())
        assert review.status.user_info.username == operator_sa
        assert "system:serviceaccounts" in review.status.user_info.groups
        assert client.AppsV1Api(api).list_namespaced_deployment(namespace).items == []
        with pytest.raises(ApiException) as caught:
            client.CoreV1Api(api).list_namespaced_secret(namespace)
        assert caught.value.status == 403


def test_unknown_credentials_are_refused(bare_controlplane: ControlPlane) -> None:
    with bare_controlplane.api_client() as admin:
        host, ca = admin.configuration.host, admin.configuration.ssl_ca_cert
    forged = client.Configuration(
        host=host, api_key={"authorization": "not-a-token"}, api_key_prefix={"authorization": "Bearer"}
    )
    forged.ssl_ca_cert = ca
    with client.ApiClient(forged) as api:
        with pytest.raises(ApiException) as caught:
            client.CoreV1Api(api).list_namespace()
        assert caught.value.status == 401


def test_impersonation_carries_every_requested_group(bare_controlplane: ControlPlane) -> None:
    groups = ("kvtier-viewers", "kvtier-oncall")
    with bare_controlplane.api_client(impersonate="alice", groups=groups) as api:
        review = client.AuthenticationV1Api(api).create_self_subject_review(client.V1SelfSubjectReview())
    assert review.status.user_info.username == "alice"
    assert set(groups) <= set(review.status.user_info.groups)
