"""The chart, rendered by a real helm: lint, offline schema validation of every manifest, and what each
manifest must say (security settings, probes, least-privilege RBAC, the CRD copy, the optional parts)."""
from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart.values_sets import ALL, EVERYTHING_ON, MINIMAL, NAMESPACED

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvtier"
K8S_VERSION = "1.37.0"
# Kinds whose schemas are not Kubernetes' own: checked by the tests below, not by kubernetes-validate.
NON_CORE = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
            ("kopf.dev/v1", "ClusterKopfPeering"), ("kopf.dev/v1", "KopfPeering")}


def kinds(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind):
    found = kinds(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# ---------------------------------------------------------------------------------------------- helm checks


@pytest.mark.parametrize("name", sorted(ALL))
def test_helm_lint_strict(helm, name, tmp_path):
    values = tmp_path / "values.json"
    values.write_text(json.dumps(ALL[name]))
    result = helm.run("lint", "--strict", str(CHART), "--values", str(values))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("name", sorted(ALL))
def test_every_rendered_manifest_is_valid_kubernetes(helm, name):
    docs = helm.template(ALL[name])
    problems, checked = [], 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in NON_CORE:
            continue
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        checked += 1
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{where}: {err.message} at {list(err.path)}")
    assert problems == []
    assert checked >= 4  # ServiceAccount, ClusterRole, ClusterRoleBinding, Deployment at the least


def test_kubernetes_validate_catches_a_bad_manifest(helm):
    # The validation above can fail: an unknown field in the rendered Deployment is caught.
    deployment = one(helm.template(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# ---------------------------------------------------------------------------------------------- values schema


@pytest.mark.parametrize("values, field", [
    ({"imagee": {}}, "imagee"),
    ({"image": {"tagg": "x"}}, "tagg"),
    ({"operator": {"verbose": "yes"}}, "operator/verbose"),
    ({"securityContext": {"readOnlyRootFilesystem": False}}, "securityContext/readOnlyRootFilesystem"),
    ({"podSecurityContext": {"runAsNonRoot": False}}, "podSecurityContext/runAsNonRoot"),
    ({"image": {"digest": "sha256:abc"}}, "image/digest"),
    ({"slo": {"authSecrets": ["Not_A_Namespace"]}}, "slo/authSecrets/0"),
    ({"metrics": {"port": 70000}}, "metrics/port"),
    ({"replicaCount": "2"}, "replicaCount"),
])
def test_values_schema_rejects_bad_values_naming_the_field(helm, values, field):
    with pytest.raises(AssertionError) as err:
        helm.template(values)
    text = str(err.value)
    # Helm 4 writes the field as /a/b, Helm 3 as a.b (or a.0); both name it.
    assert "schema" in text and (field in text or field.replace("/", ".") in text), text


@pytest.mark.parametrize("values, message", [
    ({"replicaCount": 2}, "replicaCount > 1 needs peering.enabled=true"),
    ({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}, "needs metrics.enabled"),
    ({"serviceAccount": {"create": False}}, "serviceAccount.name is required"),
])
def test_inconsistent_values_fail_with_the_rule(helm, values, message):
    with pytest.raises(AssertionError) as err:
        helm.template(values)
    assert message in str(err.value)


def test_values_yaml_sets_every_key_the_schema_declares():
    # The schema forbids unknown keys; values.yaml must show every key a user may set, with its default.
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node, value, path):
        if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is False:
            assert isinstance(value, dict), path
            declared = set(node["properties"]) - {"global"}
            assert set(value) == declared, f"{path}: values.yaml {sorted(value)} vs schema {sorted(declared)}"
            for key in declared:
                walk(node["properties"][key], value[key], f"{path}.{key}")

    walk(schema, values, "values")


# ---------------------------------------------------------------------------------------------- the operator pod


def test_operator_pod_is_non_root_read_only_with_resources_and_probes(helm):
    deployment = one(helm.template(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["requests"]["memory"] and container["resources"]["limits"]["memory"]
    # Probes hit kopf's liveness endpoint, on the port the --liveness argument opens.
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["command"] == ["kvtier", "operator"]
    # A read-only root still needs a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    # Exactly the flags `kvtier operator` defines (a flag it does not know would crash-loop the pod).
    assert container["args"] == ["--liveness=http://0.0.0.0:8080/healthz", "--standalone", "--metrics-port=9090"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_ports_and_namespaces_follow_the_values(helm):
    docs = helm.template({"health": {"port": 8181}, "metrics": {"port": 9191}, **NAMESPACED})
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--liveness=http://0.0.0.0:8181/healthz" in container["args"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"health": 8181, "metrics": 9191}
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        "--namespace=serving", "--namespace=staging"]
    assert "--peering=kvtier" in container["args"]
    assert {p["metadata"]["name"] for p in kinds(docs, "KopfPeering")} == {"kvtier"}
    service = one(docs, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9191, "targetPort": "metrics", "protocol": "TCP"}]


def test_admin_trust_settings_become_operator_flags(helm):
    # Issue 24: the PVC allowlist and the query-override switch are admin settings, off by default; each value
    # becomes the flag `kvtier operator` parses (tests/security/test_trust.py checks the parsing).
    values = {"operator": {"pvcAllowed": ["serving/kv-cache", "staging/*"]}, "slo": {"allowQueryOverrides": True,
              "prometheus": {"allowed": ["prometheus.monitoring.svc:9090"]}}}
    args = one(helm.template(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith(("--pvc-allow", "--allow-query", "--prometheus-allow"))] == [
        "--prometheus-allow=prometheus.monitoring.svc:9090", "--pvc-allow=serving/kv-cache", "--pvc-allow=staging/*",
        "--allow-query-overrides"]
    from kvtier_operator.settings import from_args
    s = from_args(args, env={})
    assert s.pvc_allowed == ("serving/kv-cache", "staging/*") and s.allow_query_overrides
    with pytest.raises(AssertionError) as err:
        helm.template({"operator": {"pvcAllowed": ["just-a-claim"]}})
    assert "pvcAllowed" in str(err.value)


def test_remote_store_allowlist_becomes_operator_flags(helm):
    values = {"operator": {"remoteStoresAllowed": ["valkey.kv.svc:6379", "redis://valkey.kv.svc:6379"]}}
    args = one(helm.template(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--remote-store-allow")] == [
        "--remote-store-allow=valkey.kv.svc:6379", "--remote-store-allow=redis://valkey.kv.svc:6379"]
    from kvtier_operator.settings import from_args
    assert from_args(args, env={}).remote_stores_allowed == ("valkey.kv.svc:6379", "redis://valkey.kv.svc:6379")
    default = one(helm.template({}), "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in default if a.startswith("--remote-store-allow")]
    for bad in ("valkey", "redis://u:p@v:6379", "http://v:6379"):
        with pytest.raises(AssertionError) as err:
            helm.template({"operator": {"remoteStoresAllowed": [bad]}})
        assert "remoteStoresAllowed" in str(err.value), bad


def test_image_digest_wins_over_tag(helm):
    docs = helm.template({"image": {"tag": "9.9.9", "digest": "sha256:" + "b" * 64}})
    image = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "ghcr.io/kvtier/kvtier-operator@sha256:" + "b" * 64


# ---------------------------------------------------------------------------------------------- RBAC


def _grants(rules):
    """{(apiGroup, resource): set(verbs)} with no wildcard anywhere."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(field, []), f"wildcard in {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


OPERATOR_NAMESPACED = {
    ("kvtier.io", "kvcachepolicies"): {"get", "list", "watch", "patch", "update"},
    ("kvtier.io", "kvcachepolicies/status"): {"get", "patch", "update"},
    ("kvtier.io", "kvcachepolicies/finalizers"): {"update"},
    ("apps", "deployments"): {"get", "list", "watch", "patch"},
    ("apps", "statefulsets"): {"get", "list", "watch", "patch"},
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create"},
}
OPERATOR_CLUSTER = {
    ("", "nodes"): {"get", "list"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}


def _operator_roles(docs, release="kvtier"):
    fullname = f"{release}-kvtier" if "kvtier" not in release else release
    cluster = [r for r in kinds(docs, "ClusterRole") if r["metadata"]["name"] == f"{fullname}-cluster"]
    return cluster, kinds(docs, "Role")


def test_default_rbac_is_exactly_what_the_operator_uses(helm):
    docs = helm.template()
    (cluster,), roles = _operator_roles(docs)
    assert _grants(cluster["rules"]) == {**OPERATOR_CLUSTER, **OPERATOR_NAMESPACED}
    assert roles == [], "no Secrets, no namespaced Roles by default"
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == cluster["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvtier", "namespace": "kvtier-system"}]
    assert one(docs, "ServiceAccount")["metadata"]["name"] == "kvtier"


def test_secrets_only_in_the_named_namespaces(helm):
    docs = helm.template({"slo": {"authSecrets": ["serving", "team-b"]}})
    everything = [r for kind in ("ClusterRole", "Role") for r in kinds(docs, kind)]
    with_secrets = {(r["metadata"].get("namespace"), r["metadata"]["name"]): _grants(r["rules"])
                    for r in everything if any("secrets" in rule["resources"] for rule in r["rules"])}
    assert with_secrets == {
        ("serving", "kvtier-slo-secrets"): {("", "secrets"): {"get"}},
        ("team-b", "kvtier-slo-secrets"): {("", "secrets"): {"get"}},
    }
    bindings = {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in kinds(docs, "RoleBinding")}
    assert bindings == {("serving", "kvtier-slo-secrets"), ("team-b", "kvtier-slo-secrets")}


def test_remote_tier_secrets_are_readable_by_name_only_in_the_listed_namespaces(helm):
    # The operator checks that a remote tier's Secrets consent to its store: get, never list, and only where the
    # admin listed the namespace.
    docs = helm.template({"operator": {"remoteSecretNamespaces": ["serving"]}})
    everything = [r for kind in ("ClusterRole", "Role") for r in kinds(docs, kind)]
    with_secrets = {(r["metadata"].get("namespace"), r["metadata"]["name"]): _grants(r["rules"])
                    for r in everything if any("secrets" in rule["resources"] for rule in r["rules"])}
    assert with_secrets == {("serving", "kvtier-remote-secrets"): {("", "secrets"): {"get"}}}
    bindings = {(b["metadata"]["namespace"], b["roleRef"]["name"]) for b in kinds(docs, "RoleBinding")}
    assert ("serving", "kvtier-remote-secrets") in bindings
    # The operator is told the same list: it checks it before any read, whatever other Role would allow the read.
    [deployment] = kinds(docs, "Deployment")
    assert "--remote-secret-namespace=serving" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_watched_namespaces_get_roles_not_cluster_rights(helm):
    docs = helm.template(NAMESPACED)
    (cluster,), roles = _operator_roles(docs)
    assert _grants(cluster["rules"]) == {**OPERATOR_CLUSTER, ("", "namespaces"): {"get", "list", "watch"}}
    peering = {("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}
    operator_roles = {r["metadata"]["namespace"]: _grants(r["rules"]) for r in roles
                      if r["metadata"]["name"] == "kvtier"}
    assert operator_roles == {ns: {**OPERATOR_NAMESPACED, **peering} for ns in ("serving", "staging")}
    peerings = kinds(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["serving", "staging"]


def test_cluster_wide_peering(helm):
    docs = helm.template({"peering": {"enabled": True}, "replicaCount": 3}, release="blue")
    (cluster,), _ = _operator_roles(docs, release="blue")
    assert _grants(cluster["rules"])[("kopf.dev", "clusterkopfpeerings")] == {"get", "list", "watch", "patch"}
    # Named after the release, so two releases in one cluster never share a peering object.
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "blue-kvtier"
    assert "--peering=blue-kvtier" in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    crds = {c["metadata"]["name"] for c in kinds(docs, "CustomResourceDefinition")}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= crds
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"


def test_aggregated_view_and_edit_roles(helm):
    docs = helm.template()
    roles = {r["metadata"]["name"]: r for r in kinds(docs, "ClusterRole")}
    view, edit = roles["kvtier-view"], roles["kvtier-edit"]
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert _grants(view["rules"]) == {("kvtier.io", "kvcachepolicies"): {"get", "list", "watch"},
                                      ("kvtier.io", "kvcachepolicies/status"): {"get", "list", "watch"}}
    assert _grants(edit["rules"]) == {
        ("kvtier.io", "kvcachepolicies"): {"create", "update", "patch", "delete", "deletecollection"}}
    assert not [r for r in kinds(helm.template(MINIMAL), "ClusterRole") if "view" in r["metadata"]["name"]]


def test_rbac_can_be_left_to_the_user(helm):
    docs = helm.template({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "mine"}})
    assert not [d for d in docs if d["apiVersion"].startswith("rbac.")]
    assert not kinds(docs, "ServiceAccount")
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


# ---------------------------------------------------------------------------------------------- CRDs


def test_chart_crd_copy_is_identical_to_crds_dir():
    source = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    copy = sorted(p.name for p in (CHART / "crds-source").glob("*.yaml"))
    assert copy == source, "run tools/sync-chart-crds.sh"
    for name in source:
        assert (CHART / "crds-source" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/kvtier/crds-source/{name} differs from crds/{name}: run tools/sync-chart-crds.sh")


def test_rendered_crd_is_crds_dir_plus_keep_annotation_and_labels(helm):
    rendered = {c["metadata"]["name"]: c for c in kinds(helm.template(), "CustomResourceDefinition")
                if c["spec"]["group"] == "kvtier.io"}
    for path in (ROOT / "crds").glob("*.yaml"):
        source = yaml.safe_load(path.read_text())
        crd = rendered.pop(source["metadata"]["name"])
        assert crd["metadata"]["annotations"].pop("helm.sh/resource-policy") == "keep"
        assert crd["metadata"].pop("labels")["app.kubernetes.io/part-of"] == "kvtier"
        assert crd == source
    assert rendered == {}


def test_crds_can_be_left_out(helm):
    crds = kinds(helm.template({"crds": {"enabled": False}}), "CustomResourceDefinition")
    assert {c["spec"]["group"] for c in crds} == {"kopf.dev"}  # Helm's crds/ directory: --skip-crds omits them
    assert not kinds(helm.template({"crds": {"enabled": False}}, include_crds=False), "CustomResourceDefinition")


# ---------------------------------------------------------------------------------------------- monitoring


def test_service_monitor_scrapes_the_metrics_service(helm):
    docs = helm.template(EVERYTHING_ON)
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    # The operator's series carry the policy's namespace label; it must survive the scrape.
    assert all(e["honorLabels"] is True for e in monitor["spec"]["endpoints"])
    assert service["spec"]["selector"].items() <= one(docs, "Deployment")["spec"]["template"]["metadata"][
        "labels"].items()


def test_prometheus_rule_carries_the_rule_file_unchanged(helm):
    rule = one(helm.template(EVERYTHING_ON), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())
    assert isinstance(rule["spec"]["groups"], list)


def test_optional_monitoring_is_off_by_default(helm):
    docs = helm.template()
    assert not kinds(docs, "ServiceMonitor") and not kinds(docs, "PrometheusRule")
    assert not [c for c in kinds(docs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]


def test_dashboard_configmap_holds_the_dashboard_file(helm):
    docs = helm.template({"grafana": {"dashboard": {"enabled": True, "namespace": "monitoring"}}})
    (cm,) = [c for c in kinds(docs, "ConfigMap") if c["metadata"]["name"] == "kvtier-dashboard"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvtier.json"]) == json.loads((CHART / "files" / "grafana-dashboard.json").read_text())


# ---------------------------------------------------------------------------------------------- NOTES


def test_notes_tell_the_user_the_config_argument(helm):
    out = helm.run("install", "kvtier", str(CHART), "--namespace", "kvtier-system", "--dry-run=client").stdout
    notes = out[out.index("NOTES:"):]
    assert "--config /etc/kvtier/engine.yaml" in notes
    assert "--extra_llm_api_options /etc/kvtier/engine.yaml" in notes
    assert "cannot read Secrets" in notes


# ---------------------------------------------------------------------------------------------- the operator's CLI


@pytest.mark.parametrize("name", sorted(ALL))
def test_rendered_args_parse_with_the_operators_own_flags(helm, name):
    import kvtier_operator.settings as settings

    values = ALL[name]
    container = one(helm.template(values), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvtier", "operator"]
    parsed = settings.from_args(container["args"], env={})
    assert parsed.namespaces == tuple(values.get("operator", {}).get("watchNamespaces", ()))
    assert parsed.standalone == (not values.get("peering", {}).get("enabled", False))
    assert parsed.peering_name == (None if parsed.standalone else "kvtier")
    assert parsed.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert parsed.metrics_port == (None if values.get("metrics", {}).get("enabled") is False else 9090)
    init = values.get("initImage")
    assert parsed.cleanup_image == (f"{init['repository']}:{init['tag']}" if init else settings.DEFAULT_CLEANUP_IMAGE)


def test_packaged_chart_renders_the_same(helm, tmp_path):
    # .helmignore must keep everything the templates read (crds-source/, files/, crds/).
    helm.run("package", str(CHART), "--destination", str(tmp_path))
    (archive,) = tmp_path.glob("kvtier-*.tgz")
    packaged = helm.run("template", "kvtier", str(archive), "--namespace", "kvtier-system", "--include-crds",
                        "--set", "grafana.dashboard.enabled=true,metrics.prometheusRule.enabled=true").stdout
    source = helm.template_text({"grafana": {"dashboard": {"enabled": True}},
                                 "metrics": {"prometheusRule": {"enabled": True}}})
    assert packaged == source
