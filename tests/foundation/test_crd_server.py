"""The generated CRD on a real kube-apiserver: accepted, defaults applied, and every rule `kvtier validate`
enforces offline rejected by the server too, at the same field path (CEL rules with the same message)."""
import pytest
import yaml
from foundation.policies import INVALID, INVALID_METADATA, VALID, policy
from kvtier_operator.api.validation import PolicyInvalid, parse_policy

pytestmark = pytest.mark.controlplane


def _server_apply(controlplane, namespace, doc):
    doc = {**doc, "metadata": {"name": "p", "namespace": namespace}}
    return controlplane.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False)


@pytest.mark.parametrize("doc", VALID)
def test_server_accepts_what_validate_accepts(controlplane, namespace, doc):
    out = _server_apply(controlplane, namespace, doc)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("doc, expected", INVALID)
def test_server_rejects_what_validate_rejects(controlplane, namespace, doc, expected):
    out = _server_apply(controlplane, namespace, doc)
    assert out.returncode != 0, f"server accepted a policy kvtier validate rejects: {expected}"
    path, _, message = expected.partition(": ")
    assert path in out.stderr, out.stderr
    with pytest.raises(PolicyInvalid) as offline:
        parse_policy(doc)
    # A CEL rule's message reads the same from the server as from `kvtier validate`.
    for problem in offline.value.problems:
        if problem.source == "cel" and problem.path == path:
            assert problem.message in out.stderr, out.stderr


def test_server_applies_the_same_defaults_validate_sees(controlplane, namespace):
    doc = policy()
    doc["metadata"] = {"name": "defaults", "namespace": namespace}
    controlplane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    stored = yaml.safe_load(controlplane.kubectl("get", "kvp", "defaults", "-n", namespace, "-o", "yaml").stdout)
    offline = parse_policy(doc).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert stored["spec"] == offline["spec"]


@pytest.mark.parametrize("metadata, expected", INVALID_METADATA)
def test_server_rejects_the_metadata_validate_rejects(controlplane, namespace, metadata, expected):
    doc = {**policy(), "metadata": {**metadata, "namespace": namespace}}
    with pytest.raises(PolicyInvalid) as offline:
        parse_policy(doc)
    assert any(str(p).startswith(expected) for p in offline.value.problems), offline.value.problems
    out = controlplane.kubectl("create", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False)
    assert out.returncode != 0, f"server accepted metadata kvtier validate rejects: {expected}"
    field = expected.partition(": ")[2].partition(" must")[0] if expected.startswith("(document)") else \
        expected.partition("[")[0].partition(":")[0]
    assert field in out.stderr, out.stderr


def test_server_agrees_on_a_63_character_name(controlplane, namespace):
    doc = {**policy(), "metadata": {"name": "a" * 63, "namespace": namespace}}
    parse_policy(doc)
    out = controlplane.kubectl("create", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), check=False)
    assert out.returncode == 0, out.stderr
