"""The checked-in CRD is exactly what the models generate, and it is a valid structural schema."""
import pathlib

import celpy
import yaml
from kvtier_operator.api import crd

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "kvtier.io_kvcachepolicies.yaml"


def _nodes(node, path="openAPIV3Schema"):
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if "items" in node:
        yield from _nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_matches_the_models():
    assert CRD_FILE.read_text() == crd.crd_yaml(), (
        "crds/ is stale: run `kvtier crd > crds/kvtier.io_kvcachepolicies.yaml`")


def test_schema_is_structural():
    schema = crd.openapi_schema()
    for path, node in _nodes(schema):
        assert "$ref" not in node and "$defs" not in node, path
        assert "title" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
        elif path != "openAPIV3Schema.metadata":
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_spec_and_status_field_is_described():
    # `kubectl explain kvcachepolicy.spec.tiers` is only useful if every field says what it is for.
    schema = crd.openapi_schema()
    missing = [
        p for top in ("spec", "status") for p, n in _nodes(schema["properties"][top], top)
        if not n.get("description") and not p.endswith("{}") and not (p.endswith("[]") and "properties" not in n)
    ]
    assert missing == []


def test_every_cel_rule_compiles_and_names_a_message():
    env = celpy.Environment()
    rules = [r for _, n in _nodes(crd.openapi_schema()) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 20
    for rule in rules:
        env.compile(rule["rule"])
        assert rule.get("message") or rule.get("messageExpression")
        if "messageExpression" in rule:
            env.compile(rule["messageExpression"])


def test_names_and_printer_columns():
    doc = yaml.safe_load(CRD_FILE.read_text())
    names = doc["spec"]["names"]
    assert (doc["spec"]["group"], names["kind"], names["plural"], names["shortNames"]) == (
        "kvtier.io", "KVCachePolicy", "kvcachepolicies", ["kvp"])
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Engine", "Tiers", "SLO", "Hits", "Ready", "Age"]


def test_hit_ratio_fields_are_in_the_schema_and_the_summary_is_a_printer_column():
    """The guard's measured hit ratios: status.tiers[].hitRatio and deviceHitRatio bounded to [0, 1], the
    status.hitRatios summary shown by kubectl get, and spec.slo.idleWindow bounded like every duration."""
    doc = yaml.safe_load(CRD_FILE.read_text())
    version = doc["spec"]["versions"][0]
    [hits] = [c for c in version["additionalPrinterColumns"] if c["name"] == "Hits"]
    assert (hits["type"], hits["jsonPath"]) == ("string", ".status.hitRatios")
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    status = schema["status"]["properties"]
    tier = status["tiers"]["items"]["properties"]["hitRatio"]
    assert (tier["type"], tier["minimum"], tier["maximum"]) == ("number", 0, 1)
    assert (status["deviceHitRatio"]["minimum"], status["deviceHitRatio"]["maximum"]) == (0, 1)
    assert status["hitRatios"]["type"] == "string" and status["hitRatios"]["maxLength"] == 512
    idle = schema["spec"]["properties"]["slo"]["properties"]["idleWindow"]
    assert idle["default"] == "1h" and idle["maxLength"] == 32
    assert any("24h" in r["rule"] for r in idle["x-kubernetes-validations"])
