"""The operator's trust rules as pure functions, and the reconcile decisions they drive (no cluster needed; the
same rules on a real API server, as a user who may only create policies: test_least_privilege.py)."""
from __future__ import annotations

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.labels import OPT_IN_LABEL
from kvtier_operator.settings import POLICY_LABEL, Settings, from_args
from kvtier_operator.status import condition
from kvtier_operator.trust import (
    check_endpoint_entry,
    endpoint_problem,
    host_path_problems,
    opted_in,
    owns_config_map,
    redacted,
    under_prefix,
)
from plugins.operator import deployment, nvme_tier, observed, policy

NOW = "2026-12-01T08:00:00Z"
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}


def test_opt_in_is_the_owners_label_naming_the_policy_or_any():
    assert opted_in({OPT_IN_LABEL: "llm"}, "llm")
    assert opted_in({OPT_IN_LABEL: "true"}, "llm")
    assert not opted_in({OPT_IN_LABEL: "other"}, "llm")
    assert not opted_in({}, "llm")
    # The label kvtier itself writes is not consent: otherwise its own apply would keep a workload opted in.
    assert not opted_in({POLICY_LABEL: "llm"}, "llm")


def test_a_workload_without_opt_in_is_left_alone_and_the_policy_says_why():
    wl = observed(deployment(opt_in=None))
    p = rc.plan(policy(), [wl], [], now=NOW)
    [t] = p.targets
    assert t.state == rc.NOT_OPTED_IN and t.apply is None and t.args_update is None and not t.remove
    assert f"{OPT_IN_LABEL}: llm" in t.message
    assert condition(p.status, "Ready")["reason"] == rc.NOT_OPTED_IN
    assert condition(p.status, "Degraded")["status"] == "True"
    # Opted in to another policy: the same.
    assert rc.plan(policy(), [observed(deployment(opt_in="other"))], [], now=NOW).targets[0].state == rc.NOT_OPTED_IN


def test_managed_args_are_not_written_without_opt_in():
    wl = observed(deployment(opt_in=None, args=["--model", "m"]))
    [t] = rc.plan(policy(injection={"args": "managed"}), [wl], [], now=NOW).targets
    assert t.args_update is None and t.apply is None


def test_withdrawing_the_opt_in_releases_the_workload():
    wl = observed(deployment(opt_in=None))
    wl["metadata"]["labels"][POLICY_LABEL] = "llm"  # applied earlier, when it was opted in
    [t] = rc.plan(policy(), [wl], [], now=NOW).targets
    assert t.state == rc.RELEASED and t.remove


def test_missing_config_argument_applies_nothing_not_even_with_opt_in():
    wl = observed(deployment(args=["--model", "m"]))
    [t] = rc.plan(policy(), [wl], [], now=NOW).targets
    assert t.state == rc.MISSING_ARG and t.apply is None and t.args_update is None


def test_host_path_tiers_need_an_admin_prefix():
    pol = policy(tiers=[CPU, nvme_tier()])  # hostPath /mnt/disks/nvme0
    refused = rc.plan(pol, [observed(deployment())], [], now=NOW)
    assert refused.targets == [] and refused.config_map is None
    ready = condition(refused.status, "Ready")
    assert ready["reason"] == "HostPathNotAllowed" and "spec.tiers[1].volume.hostPath.path" in ready["message"]
    assert "none are allowed" in ready["message"]
    assert rc.plan(pol, [observed(deployment())], [], now=NOW, host_path_prefixes=("/mnt/disk",)).targets == []
    ok = rc.plan(pol, [observed(deployment())], [], now=NOW, host_path_prefixes=("/mnt/disks",))
    assert ok.targets[0].state == rc.APPLIED


@pytest.mark.parametrize("path, prefix, inside", [
    ("/mnt/disks/nvme0", "/mnt/disks", True), ("/mnt/disks", "/mnt/disks", True),
    ("/mnt/disks/", "/mnt/disks", True), ("/mnt/disksx", "/mnt/disks", False), ("/mnt", "/mnt/disks", False),
    ("/mnt/disks/../../etc", "/mnt/disks", False), ("//mnt//disks/a", "/mnt/disks", True),
    ("/", "/mnt", False), ("/etc", "/", True),
])
def test_prefixes_compare_whole_segments(path, prefix, inside):
    assert under_prefix(path, prefix) is inside


def test_pvc_and_empty_dir_are_always_allowed():
    from kvtier_operator.api.validation import parse_policy

    pvc = {"name": "d", "medium": "filesystem", "size": "1Gi", "path": "/mnt/d",
           "volume": {"persistentVolumeClaim": {"claimName": "kv"}}}
    spec = parse_policy(policy(tiers=[CPU, pvc, {**pvc, "name": "e", "path": "/mnt/e",
                                                "volume": {"emptyDir": {}}}])).spec
    assert host_path_problems(spec, ()) == []


def test_a_namespace_segment_in_a_host_path_prefix_confines_each_namespace_to_its_own_directory():
    """A cluster-wide prefix lets every namespace name every path below it, so two tenants could share one
    hostPath tier's files (no key, no encryption on disk). /mnt/nvme/{namespace} allows each its own directory."""
    from kvtier_operator.api.validation import parse_policy
    from kvtier_operator.trust import check_host_path_prefix

    def spec(path: str):
        tier = {"name": "d", "medium": "filesystem", "size": "1Gi", "path": "/mnt/d",
                "volume": {"hostPath": {"path": path}}}
        return parse_policy(policy(tiers=[CPU, tier])).spec

    prefixes = ("/mnt/nvme/{namespace}",)
    assert host_path_problems(spec("/mnt/nvme/team-a"), prefixes, "team-a") == []
    assert host_path_problems(spec("/mnt/nvme/team-a/kv"), prefixes, "team-a") == []
    [refused] = host_path_problems(spec("/mnt/nvme/team-a"), prefixes, "team-b")
    assert refused.startswith("spec.tiers[1].volume.hostPath.path: '/mnt/nvme/team-a' is not under a node path")
    assert host_path_problems(spec("/mnt/nvme/team-ab"), prefixes, "team-a"), "segment by segment"
    assert check_host_path_prefix("/mnt/{namespace}/kv") is None
    for bad in ("/mnt/x{namespace}", "/mnt/{ns}", "/mnt/{namespace"):
        assert check_host_path_prefix(bad) == "may hold {namespace} only as a whole path segment", bad


def test_config_map_ownership():
    cm = {"metadata": {"name": "kvtier-llm", "ownerReferences": [{"kind": "KVCachePolicy", "name": "llm",
                                                                   "uid": "u1"}]}}
    assert owns_config_map(cm, "llm", "u1")
    assert not owns_config_map(cm, "llm", "u2")
    # Class B (adopting a foreign object): labels anyone can write are no proof of ownership.
    labelled = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "kvtier-operator", POLICY_LABEL: "llm"}}}
    assert not owns_config_map(labelled, "llm", "u1")
    assert not owns_config_map({"metadata": {"name": "kvtier-llm"}}, "llm", "u1")
    assert not owns_config_map(None, "llm", "u1")


ALLOWED = ("prometheus.monitoring.svc", "thanos:10902", "https://metrics.example.com/prom",
           "http://plain.monitoring:9090", "any.monitoring:*")


@pytest.mark.parametrize("url, allow_http, refused", [
    ("https://prometheus.monitoring.svc", False, None),
    ("https://PROMETHEUS.monitoring.svc:443", False, None),
    ("http://prometheus.monitoring.svc", False, "plain http"),
    ("http://prometheus.monitoring.svc", True, None),
    # Class D (an allowlist on raw text): a host-only entry means the scheme's default port, not every port.
    ("https://prometheus.monitoring.svc:9090", False, "not a Prometheus endpoint the operator's admin allows"),
    ("http://prometheus.monitoring.svc:443", True, "not a Prometheus endpoint"),
    ("https://any.monitoring:12345", False, None),  # host:* says "any port" explicitly
    # ... and the path is compared decoded, segment by segment; encoded separators are refused outright.
    ("https://metrics.example.com/prom/%2e%2e/admin", False, "percent-encoded"),
    ("https://metrics.example.com/prom/%2E%2E%2Fadmin", False, "percent-encoded"),
    ("https://metrics.example.com/prom%2fx", False, "percent-encoded"),
    ("https://metrics.example.com/prom/../admin", False, "'.' or '..'"),
    ("https://metrics.example.com/prom/./v1", False, "'.' or '..'"),
    ("https://metrics.example.com/prom/..;/admin", False, "'.' or '..'"),
    ("https://metrics.example.com/prom/%252e%252e/admin", False, "percent-encoded"),
    ("https://metrics.example.com/prom\\..\\admin", False, "backslash"),
    ("https://metrics.example.com/%70rom/v1", False, None),  # decoded: /prom/v1
    ("https://metrics.example.com:443/prom", False, None),  # the entry's port is the scheme's default
    ("https://metrics.example.com:8443/prom", False, "not a Prometheus endpoint"),
    ("https://thanos:10902/api", False, None),
    ("https://thanos:9090", False, "not a Prometheus endpoint the operator's admin allows"),
    ("https://metrics.example.com/prom", False, None),
    ("https://metrics.example.com/prom/v1", False, None),
    ("https://metrics.example.com/promx", False, "not a Prometheus endpoint"),
    ("https://metrics.example.com/", False, "not a Prometheus endpoint"),
    ("http://metrics.example.com/prom", True, "not a Prometheus endpoint"),  # the entry says https
    ("http://plain.monitoring:9090", False, None),  # an entry written as http:// allows exactly that
    ("http://plain.monitoring:9091", True, "not a Prometheus endpoint"),
    ("https://attacker.example", True, "not a Prometheus endpoint"),
    ("https://prometheus.monitoring.svc.attacker.example", True, "not a Prometheus endpoint"),
    ("https://user:hunter2@prometheus.monitoring.svc", True, "credentials"),
    ("https://prometheus.monitoring.svc/?x=1", True, "'?' or '#'"),
    ("https://prometheus.monitoring.svc/#x", True, "'?' or '#'"),
    ("ftp://prometheus.monitoring.svc", True, "http:// or https://"),
    ("https://:9090", True, "with a host"),
])
def test_endpoint_allowlist(url, allow_http, refused):
    problem = endpoint_problem(url, ALLOWED, allow_http)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem
        assert "hunter2" not in problem  # credentials are never repeated


def test_nothing_is_allowed_by_default():
    assert Settings().prometheus_allowed == () and not Settings().prometheus_allow_http
    assert Settings().host_path_prefixes == ()
    assert "not a Prometheus endpoint" in endpoint_problem("https://prometheus:9090", (), True)


def test_admin_settings_from_flags_and_env():
    s = from_args(["--hostpath-prefix", "/mnt/nvme", "--prometheus-allow", "prom:9090"],
                  env={"KVTIER_PROMETHEUS_ALLOW_HTTP": "true"})
    assert s.host_path_prefixes == ("/mnt/nvme",) and s.prometheus_allowed == ("prom:9090",)
    assert s.prometheus_allow_http
    s = from_args([], env={"KVTIER_HOSTPATH_PREFIXES": "/a, /b", "KVTIER_PROMETHEUS_ALLOWED": "p1,https://p2"})
    assert s.host_path_prefixes == ("/a", "/b") and s.prometheus_allowed == ("p1", "https://p2")
    for argv, words in ((["--hostpath-prefix", "mnt"], "absolute"), (["--hostpath-prefix", "/a/../b"], "'..'"),
                        (["--prometheus-allow", "https://u:p@h"], "credentials"),
                        (["--prometheus-allow", "ftp://h"], "http")):
        with pytest.raises(SystemExit, match=words):
            from_args(argv, env={})
    assert check_endpoint_entry("prom.monitoring:9090") is None


def test_redacted_url_drops_credentials_query_and_fragment():
    assert redacted("https://u:secret@prom:9090/x?token=1#f") == "https://prom:9090/x"


def test_a_stored_policy_with_a_name_too_long_for_a_label_gets_a_condition():
    name = "p" * 70  # stored before the CRD's rule existed; the server-validated path skips CEL
    p = rc.plan(policy(name, selector={"matchLabels": {"app": "llm"}}), [observed(deployment())], [], now=NOW,
                server_validated=True)
    assert p.invalid and p.targets == [] and p.config_map is None
    assert "metadata.name: must be at most 63" in condition(p.status, "Ready")["message"]


# ---------------------------------------------------------------------------------------------- issue 24, class F

def test_class_f_pvc_tiers_need_the_admins_allowlist():
    pvc = {"name": "disk", "medium": "filesystem", "size": "1Gi", "path": "/mnt/kv",
           "volume": {"persistentVolumeClaim": {"claimName": "data"}}}
    pol = policy(tiers=[CPU, pvc])
    refused = rc.plan(pol, [observed(deployment())], [], now=NOW)
    assert refused.invalid and refused.targets == []
    assert condition(refused.status, "Ready")["reason"] == "PersistentVolumeClaimNotAllowed"
    for allowed in (("default/data",), ("default/*",), ("*/data",)):
        assert not rc.plan(pol, [observed(deployment())], [], now=NOW, pvc_allowed=allowed).invalid, allowed
    for other in (("other/data",), ("default/datax",)):
        assert rc.plan(pol, [observed(deployment())], [], now=NOW, pvc_allowed=other).invalid, other


def test_class_f_admin_switches_default_off_and_parse():
    assert Settings().pvc_allowed == () and not Settings().allow_query_overrides
    s = from_args(["--pvc-allow", "serving/kv", "--allow-query-overrides"], env={})
    assert s.pvc_allowed == ("serving/kv",) and s.allow_query_overrides
    s = from_args([], env={"KVTIER_PVC_ALLOWED": "a/*, */b", "KVTIER_ALLOW_QUERY_OVERRIDES": "true"})
    assert s.pvc_allowed == ("a/*", "*/b") and s.allow_query_overrides
    for bad in ("claim", "a/b/c", "A/b", "/b"):
        with pytest.raises(SystemExit, match="NAMESPACE/CLAIM"):
            from_args(["--pvc-allow", bad], env={})


def test_class_f_condition_messages_are_bounded_whatever_the_number_of_targets():
    workloads = [observed(deployment(f"llm-{i:03d}", labels={"app": "llm"}, args=["--model", "m"]))
                 for i in range(300)]
    p = rc.plan(policy(), workloads, [], now=NOW)
    assert len(p.targets) == 300
    for c in p.status["conditions"]:
        assert len(c["message"]) < 8192, (c["type"], len(c["message"]))
    assert "and 295 more (295 MissingConfigArgument" in condition(p.status, "Ready")["message"]
