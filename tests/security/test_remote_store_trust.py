"""A remote tier's store and credentials (issue #26): the serving pods send the password in a Secret to the store a
policy names, and load whatever it serves, so only stores the cluster admin listed are used, over TLS unless the
admin listed the store as redis://, and the Secret is mounted read-only, never read by the operator."""
from __future__ import annotations

import pytest
from kvtier_operator import reconcile as rc
from kvtier_operator.api.validation import parse_policy
from kvtier_operator.settings import Settings, from_args
from kvtier_operator.status import condition
from kvtier_operator.trust import check_remote_store_entry, remote_store_problems
from plugins.operator import deployment, observed, policy

NOW = "2026-12-01T08:00:00Z"
CPU = {"name": "cpu", "medium": "cpu", "size": "16Gi"}
PASSWORD = {"name": "valkey", "key": "password"}
# The tenant's key every remote tier needs (macKeySecret=None in a test leaves it out).
KEY = {"name": "kv-mac", "key": "k"}
KEY_SOURCE = {"secret": {"name": "kv-mac", "items": [{"key": "k", "path": "mac-key"}]}}
# The previous tenant key, projected while the Secret holds it (a rotation), so no rotation edits the policy.
PREVIOUS_SOURCE = {"secret": {"name": "kv-mac", "optional": True,
                              "items": [{"key": "k.previous", "path": "mac-key.previous"}]}}


def remote(url: str = "redis://valkey.kv:6379/0", **store) -> dict:
    fields = {k: v for k, v in {"url": url, "macKeySecret": KEY, **store}.items() if v is not None}
    return {"name": "shared", "medium": "remote", "size": "8Gi", "remote": fields}


def remote_policy(url: str = "redis://valkey.kv:6379/0", **store) -> dict:
    return policy(tiers=[CPU, remote(url, **store)], backend="kvtier", engine="vllm")


def plan(pol: dict, allowed: tuple[str, ...] = ()) -> rc.Plan:
    return rc.plan(pol, [observed(deployment())], [], now=NOW, remote_stores_allowed=allowed)


def problems(url: str, allowed: tuple[str, ...]) -> list[str]:
    return remote_store_problems(parse_policy(remote_policy(url)).spec, allowed)


def test_nothing_is_allowed_by_default_and_nothing_is_applied_or_mounted():
    assert Settings().remote_stores_allowed == ()
    refused = plan(remote_policy(passwordSecret=PASSWORD))
    assert refused.invalid and refused.targets == [] and refused.config_map is None
    ready = condition(refused.status, "Ready")
    assert ready["reason"] == "RemoteStoreNotAllowed"
    assert "spec.tiers[1].remote.url: redis://valkey.kv:6379/0 is not a store the operator's admin allows" in \
        ready["message"]


@pytest.mark.parametrize("url, allowed, refused", [
    ("redis://valkey.kv:6379", ("redis://valkey.kv:6379",), None),
    ("redis://valkey.kv:6379/3", ("redis://valkey.kv:6379",), None),          # any database of an allowed store
    ("redis://VALKEY.kv:6379", ("redis://valkey.kv:6379",), None),            # host names compare case-free
    ("rediss://valkey.kv:6380", ("valkey.kv:6380",), None),                   # a bare entry: TLS only
    ("rediss://valkey.kv:6379", ("rediss://valkey.kv:6379",), None),
    ("redis://valkey.kv:6379", ("valkey.kv:6379",), "plain TCP"),             # bare entry, plain URL
    ("redis://valkey.kv:6379", ("rediss://valkey.kv:6379",), "plain TCP"),
    ("rediss://valkey.kv:6379", ("redis://valkey.kv:6379",), "not a store"),  # the entry names the scheme
    ("redis://valkey.kv:6380", ("redis://valkey.kv:6379",), "not a store"),   # another port
    ("redis://valkey.kv.evil:6379", ("redis://valkey.kv:6379",), "not a store"),
    ("redis://10.0.0.1:6379", ("redis://valkey.kv:6379",), "not a store"),
    ("redis://[fd00::1]:6379", ("redis://[fd00::1]:6379",), None),
    # An entry naming a database admits that database only; databases are separate key spaces (tenants).
    ("redis://valkey.kv:6379/1", ("redis://valkey.kv:6379/1",), None),
    ("redis://valkey.kv:6379/2", ("redis://valkey.kv:6379/1",), "not a store"),
    ("redis://valkey.kv:6379", ("redis://valkey.kv:6379/1",), "not a store"),  # no db: database 0
    ("redis://valkey.kv:6379/", ("redis://valkey.kv:6379/1",), "not a store"),
    ("redis://valkey.kv:6379", ("redis://valkey.kv:6379/0",), None),
    ("redis://valkey.kv:6379/0", ("redis://valkey.kv:6379/0",), None),
    ("rediss://valkey.kv:6379/3", ("rediss://valkey.kv:6379/1", "rediss://valkey.kv:6379/3"), None),
    ("rediss://valkey.kv:6379/3", ("rediss://valkey.kv:6379/1", "valkey.kv:6379"), None),  # a bare entry: any db
])
def test_the_allowlist_matches_scheme_host_and_port(url, allowed, refused):
    found = problems(url, allowed)
    if refused is None:
        assert found == []
    else:
        assert len(found) == 1 and refused in found[0] and found[0].startswith("spec.tiers[1].remote.url: ")


def test_an_allowed_store_renders_the_tier_and_mounts_only_the_named_keys_read_only():
    pol = remote_policy(passwordSecret=PASSWORD, macKeySecret={"name": "kv-mac", "key": "k"})
    p = plan(pol, ("redis://valkey.kv:6379",))
    assert not p.invalid and p.targets and p.targets[0].apply is not None
    pod = p.targets[0].apply["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kvtier-remote-shared")
    sources = volume["projected"]["sources"]
    assert sources == [{"secret": {"name": "valkey", "items": [{"key": "password", "path": "password"}]}},
                       KEY_SOURCE, PREVIOUS_SOURCE]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kvtier-remote-shared")
    assert mount == {"name": "kvtier-remote-shared", "mountPath": "/etc/kvtier-remote/shared", "readOnly": True}
    engine = p.config_map["data"]["engine.yaml"]
    assert "password_file: /etc/kvtier-remote/shared/password" in engine
    assert "mac_key_file: /etc/kvtier-remote/shared/mac-key" in engine
    assert "previous_mac_key_file: /etc/kvtier-remote/shared/mac-key.previous" in engine
    # The operator renders references to files, never a Secret's value (it cannot read Secrets for this).
    assert "prefix-caching-hash-algo: sha256_cbor" in engine


def test_without_a_mac_key_secret_the_policy_is_refused_naming_the_field_and_the_password_never_keys():
    """The store password is every client's; a tier keyed by it (or by nothing) would let any of them read and
    forge blocks. validate, the API server's CEL rule and the operator all refuse it, naming the field."""
    from kvtier_operator.api.validation import PolicyInvalid, _cel_problems

    message = "spec.tiers[1].remote.macKeySecret: a remote tier needs remote.macKeySecret: the tenant's key"
    for pol in (remote_policy(passwordSecret=PASSWORD, macKeySecret=None), remote_policy(macKeySecret=None)):
        with pytest.raises(PolicyInvalid) as refused:
            parse_policy(pol)
        assert [str(p) for p in refused.value.problems][0].startswith(message)
        cel = [str(p) for p in _cel_problems(pol) if "macKeySecret" in str(p)]
        assert len(cel) == 1 and cel[0].startswith(message)
        p = plan(pol, ("redis://valkey.kv:6379",))
        assert p.invalid and p.targets == [] and p.config_map is None
    # With both, the key file is the key's own, never the password's; the namespace is the tenant scope.
    engine = plan(remote_policy(passwordSecret=PASSWORD), ("redis://valkey.kv:6379",)).config_map["data"]["engine.yaml"]
    assert "mac_key_file: /etc/kvtier-remote/shared/mac-key" in engine
    assert "password_file: /etc/kvtier-remote/shared/password" in engine


CA = {"name": "valkey-tls", "key": "ca.crt"}


def test_a_private_ca_joins_the_read_only_secret_volume_and_the_runtime_gets_its_path():
    """rediss:// to an in-cluster store whose certificate a private CA signed (cert-manager's ca.crt): the CA is one
    more projected key, mounted read-only with the password, never read by the operator."""
    p = plan(remote_policy("rediss://valkey.kv:6380", passwordSecret=PASSWORD, caSecret=CA), ("valkey.kv:6380",))
    assert not p.invalid and p.targets and p.targets[0].apply is not None
    pod = p.targets[0].apply["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kvtier-remote-shared")
    assert volume["projected"]["sources"] == [
        {"secret": {"name": "valkey", "items": [{"key": "password", "path": "password"}]}}, KEY_SOURCE, PREVIOUS_SOURCE,
        {"secret": {"name": "valkey-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "kvtier-remote-shared")
    assert mount == {"name": "kvtier-remote-shared", "mountPath": "/etc/kvtier-remote/shared", "readOnly": True}
    engine = p.config_map["data"]["engine.yaml"]
    assert "ca_file: /etc/kvtier-remote/shared/ca.crt" in engine
    assert "url: rediss://valkey.kv:6380" in engine
    # A store without a password: the key and the CA; without caSecret no ca_file is rendered.
    alone = plan(remote_policy("rediss://valkey.kv:6380", caSecret=CA), ("valkey.kv:6380",))
    sources = next(v for v in alone.targets[0].apply["spec"]["template"]["spec"]["volumes"]
                   if v["name"] == "kvtier-remote-shared")["projected"]["sources"]
    assert sources == [KEY_SOURCE, PREVIOUS_SOURCE, {"secret": {"name": "valkey-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]
    bare = plan(remote_policy("rediss://valkey.kv:6380", passwordSecret=PASSWORD), ("valkey.kv:6380",))
    assert "ca_file" not in bare.config_map["data"]["engine.yaml"]


def test_a_ca_with_plain_tcp_is_refused_naming_the_field_by_validate_and_by_the_operator():
    from kvtier_operator.api.validation import PolicyInvalid, _cel_problems

    message = "spec.tiers[1].remote.caSecret: allowed only with a rediss:// url: redis:// is plain TCP"
    pol = remote_policy("redis://valkey.kv:6379", passwordSecret=PASSWORD, caSecret=CA)
    with pytest.raises(PolicyInvalid) as refused:
        parse_policy(pol)
    assert [str(p) for p in refused.value.problems][0].startswith(message)
    # The CEL rule the API server runs says the same, on the same field.
    cel = [str(p) for p in _cel_problems(pol) if "caSecret" in str(p)]
    assert len(cel) == 1 and cel[0].startswith(message)
    p = plan(pol, ("redis://valkey.kv:6379",))
    assert p.invalid and p.targets == [] and p.config_map is None
    assert message in condition(p.status, "Ready")["message"]


def test_a_filesystem_tier_cannot_take_the_remote_tiers_volume_name():
    disk = {"name": "shared-secrets", "medium": "filesystem", "size": "1Gi", "path": "/mnt/kv",
            "volume": {"emptyDir": {}}}
    pol = policy(tiers=[CPU, disk, remote(passwordSecret=PASSWORD)], backend="kvtier", engine="vllm")
    p = plan(pol, ("redis://valkey.kv:6379",))
    names = [v["name"] for v in p.targets[0].apply["spec"]["template"]["spec"]["volumes"]]
    assert len(names) == len(set(names)), names


def test_admin_entries_parse_from_flags_and_env_and_bad_ones_stop_the_operator():
    s = from_args(["--remote-store-allow", "valkey.kv:6379", "--remote-store-allow", "redis://v2:6379"], env={})
    assert s.remote_stores_allowed == ("valkey.kv:6379", "redis://v2:6379")
    s = from_args([], env={"KVTIER_REMOTE_STORES_ALLOWED": "a:1, redis://b:2"})
    assert s.remote_stores_allowed == ("a:1", "redis://b:2")
    for bad in ("valkey", "http://v:6379", "redis://u:p@v:6379", "v:6379?x=1", "redis://v:6379/x"):
        assert check_remote_store_entry(bad) is not None, bad
        with pytest.raises(SystemExit, match="--remote-store-allow"):
            from_args(["--remote-store-allow", bad], env={})


def test_status_says_how_much_of_the_store_the_policy_may_use_and_clears_it_when_the_tier_is_off():
    from kvtier_operator.status import compose, status_patch

    d = deployment()
    d["spec"]["replicas"] = 3  # replicas of one model share one budget in the store (the runtime's index per model)
    other = deployment("llm-b", labels={"app": "llm"})
    pol = remote_policy()
    p = rc.plan(pol, [observed(d), observed(other)], [], now=NOW, remote_stores_allowed=("redis://valkey.kv:6379",))
    assert p.status["remoteStoreBudgetBytes"] == 2 * 8 * 2**30
    stored = compose({}, p.status)
    assert stored["remoteStoreBudgetBytes"] == 2 * 8 * 2**30
    # The SLO guard disabled the remote tier: the budget goes from status, not just from the plan.
    pol["status"] = {**stored, "tiers": [{"name": "cpu", "state": "Enabled"},
                                         {"name": "shared", "state": "Disabled", "reason": "SLOBreach"}],
                     "slo": {"disabled": ["shared"]}}
    pol["spec"]["tiers"][1]["enabled"] = False
    off = rc.plan(pol, [observed(d)], [], now=NOW, remote_stores_allowed=("redis://valkey.kv:6379",))
    assert off.status["remoteStoreBudgetBytes"] is None
    patch = status_patch(stored, compose(stored, off.status))
    assert patch is not None and patch["remoteStoreBudgetBytes"] is None
